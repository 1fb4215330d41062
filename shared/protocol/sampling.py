"""Sampling math, both sides: pure functions of tensors and explicit randomness.

* :class:`SamplingConfig`: the logit processing (temperature, top-k, top-p) applied to both the
  target's and the drafter's rows, so the output follows the processed target distribution;
* :func:`process_rows` / :func:`process_logits`: raw logits -> processed log-probs, row by row
  (each row's answer depends on that row and its config alone, so a batch of rows gives what the
  rows give one at a time);
* :func:`choose_tokens`: the target's token where it is a function of the logits - greedy (the
  argmax; temperature 0 is its own path, never a tiny temperature) or coupled sampling;
* :func:`draw_uniforms`, :func:`sample_from_probs` / :func:`sample_rows`: randomness never comes
  from a global RNG; callers draw uniforms from their own ``torch.Generator`` and one uniform
  inverts a CDF, so the verifier samples on the client's behalf and gets the client's answer.

What acceptance does with these (accepted, recovered, bonus) is ``shared.protocol.acceptance``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.protocol import GREEDY_TEMPERATURE, NO_TOP_K, NO_TOP_P
from shared.protocol.transfer import to_device

NEG_INF = float("-inf")


@dataclass(frozen=True)
class SamplingConfig:
    """Logit processing applied to both the target and the draft distributions.

    temperature 0 means greedy; top_k 0 and top_p 1.0 mean "no truncation".
    """

    temperature: float = GREEDY_TEMPERATURE
    top_k: int = NO_TOP_K
    top_p: float = NO_TOP_P
    # Reproducible sampling: every position's token is the Gumbel-max choice under noise drawn
    # from (coupling_seed, position), shared by drafter and target (see ``coupled_tokens``).
    coupling_seed: int | None = None
    # OpenAI's penalties and bias, on the raw logits before everything else (as a plain decode
    # applies them): logit - frequency_penalty * count - presence_penalty * (count > 0) + bias,
    # with count a token's occurrences among the generated tokens before the row
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def penalized(self) -> bool:
        """Some row's logits change with the sequence or the bias (:func:`penalize`)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def coupled(self) -> bool:
        return not self.greedy and self.coupling_seed is not None

    @property
    def deterministic(self) -> bool:
        """The target's token at a position is a function of its logits (greedy, or coupled
        sampling): drafts are one-hot and accepted while they equal it."""
        return self.greedy or self.coupled


def penalize(rows: torch.Tensor, config: SamplingConfig, history: dict[int, int],
             before: list[list[int]]) -> torch.Tensor:
    """[n, vocab] logits -> float32 logits with ``config``'s bias and penalties. ``history``:
    each generated token's count up to the rows (the committed ones); ``before[r]``: the
    tokens between the history and row r (a block's drafts on row r's path). A row's answer
    depends on that row, its counts and the config alone."""
    out = rows.float().clone()
    if config.logit_bias:
        ids = to_device([i for i, _ in config.logit_bias], torch.long, rows.device)
        bias = to_device([b for _, b in config.logit_bias], torch.float32, rows.device)
        out[:, ids] += bias
    if not (config.presence_penalty or config.frequency_penalty):
        return out
    # counts as a [vocab] row, built once, and each row's own drafts added to it: work of the
    # vocabulary's width a row whatever the history's length (a dict a row cost a call with a
    # long history hundreds of milliseconds, in Python, on the batch's thread)
    vocab = out.shape[-1]
    base = torch.zeros(vocab, dtype=torch.float32, device=rows.device)
    if history:
        base[to_device(list(history), torch.long, rows.device)] = to_device(
            list(history.values()), torch.float32, rows.device)
    for r, extra in enumerate(before):
        counts = base
        if extra:
            counts = base.index_add(0, to_device(extra, torch.long, rows.device),
                                    torch.ones(len(extra), device=rows.device))
        # x - 0.0 is x (also -0.0 and -inf): the unseen ids keep their bits, no host sync
        out[r] -= torch.where(counts > 0,
                              config.frequency_penalty * counts + config.presence_penalty, 0.0)
    return out


NUCLEUS_CANDIDATES = 1024  # top-p looks at the best 1024 tokens first; the rest when needed


def nucleus_drop(scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p: [R, vocab] scores, [R] float64 top_p (< 1) -> [R, vocab] True where a token is
    dropped. A token stays while the mass of the better tokens is below top_p (the smallest set
    reaching top_p; always the best token). Sorting a large vocabulary's row is slow on a CPU,
    so the best ``NUCLEUS_CANDIDATES`` come first; only rows where they hold less than top_p are
    sorted whole. A row's answer depends on that row alone (the batched acceptance needs it)."""
    probs = torch.softmax(scores.double(), dim=-1)  # [R, vocab]
    top_p = top_p[:, None]  # [R, 1]
    best = torch.topk(scores, min(NUCLEUS_CANDIDATES, scores.shape[-1]), dim=-1).indices
    keep, held = _keep_while_below(probs, best, top_p)
    short = (held < top_p[:, 0]).nonzero().flatten()  # [S] rows the candidates do not cover
    if len(short):
        order = torch.sort(scores[short], dim=-1, descending=True).indices  # [S, vocab]
        keep[short] = _keep_while_below(probs[short], order, top_p[short])[0]
    return ~keep


def _keep_while_below(probs: torch.Tensor, order: torch.Tensor,
                      top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """order: [R, n] ids, best first. ([R, vocab] kept, [R] mass of the n)."""
    ranked = probs.gather(-1, order)  # [R, n]
    mass_before = torch.cumsum(ranked, dim=-1) - ranked  # mass of the better tokens
    keep_sorted = mass_before < top_p
    keep_sorted[:, 0] = True  # the best token always stays
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, keep_sorted)
    return keep, mass_before[:, -1] + ranked[:, -1]


def process_rows(logits: torch.Tensor, configs: list[SamplingConfig]) -> torch.Tensor:
    """Raw logits -> processed log-probs with one config per row (none greedy): temperature,
    then top-k, then top-p (:func:`process_logits` for one config).

    logits: [R, vocab]; configs: [R]. Returns [R, vocab] float32 log-probs, -inf off support.
    A row's answer depends on that row and its config alone, so the verifier's batched
    acceptance matches the host path bit for bit. Which steps run is decided on the host from
    the configs, so nothing waits on the device."""
    device, vocab = logits.device, logits.shape[-1]
    raw = logits.double()  # [R, vocab]
    shifted = raw - raw.max(dim=-1, keepdim=True).values
    temperatures = {c.temperature for c in configs}
    if len(temperatures) == 1:  # one division by a float64 scalar: the same arithmetic
        scores = (shifted / temperatures.pop()).float()  # [R, vocab]
    else:
        temperature = to_device([c.temperature for c in configs], torch.float64, device)
        scores = (shifted / temperature[:, None]).float()
    top_k = [c.top_k if 0 < c.top_k < vocab else 0 for c in configs]  # 0: no top-k
    if len(set(top_k)) == 1 and top_k[0]:
        kth_best = torch.topk(scores, top_k[0], dim=-1).values[..., -1:]  # [R, 1]
        scores = scores.masked_fill(scores < kth_best, NEG_INF)
    elif any(top_k):
        best = torch.topk(scores, max(top_k), dim=-1).values  # [R, widest], descending
        kth = to_device([max(k, 1) - 1 for k in top_k], torch.long, device)  # [R]
        kth_best = best.gather(-1, kth[:, None])  # [R, 1]
        limited = to_device([k > 0 for k in top_k], torch.bool, device)  # [R]
        kth_best = torch.where(limited[:, None], kth_best, NEG_INF)
        scores = scores.masked_fill(scores < kth_best, NEG_INF)
    nucleus = [r for r, c in enumerate(configs) if c.top_p < 1.0]
    if len(nucleus) == len(configs):
        top_p = to_device([c.top_p for c in configs], torch.float64, device)
        scores = scores.masked_fill(nucleus_drop(scores, top_p), NEG_INF)
    elif nucleus:  # only these rows: each row's answer is its own (nucleus_drop)
        rows = to_device(nucleus, torch.long, device)
        top_p = to_device([configs[r].top_p for r in nucleus], torch.float64, device)
        scores = scores.clone()
        scores[rows] = scores[rows].masked_fill(nucleus_drop(scores[rows], top_p), NEG_INF)
    return torch.log_softmax(scores, dim=-1)


def process_logits(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Raw logits -> processed log-probs (temperature, then top-k, then top-p); -inf off support.

    logits: [..., vocab]. Returns float32 log-probs of the same shape. Not for greedy decoding.

    Every temperature > 0 is exact, down to the smallest subnormal: the logits are shifted by
    their maximum before the division (in float64), so the best token scores 0 and the others
    fall towards -inf - the limit as the temperature goes to 0 is greedy (the argmax, exact ties
    sharing), with no overflow and no NaN. top-p always keeps the most likely token
    (transformers' ``min_tokens_to_keep=1``), however small p is.
    """
    if config.greedy:
        raise ValueError("process_logits is for sampling; greedy decoding takes the argmax")
    rows = logits.reshape(-1, logits.shape[-1])  # [R, vocab]
    return process_rows(rows, [config] * rows.shape[0]).reshape(logits.shape)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """[..., vocab] -> [...] argmax ids (the lowest id wins a tie)."""
    return torch.argmax(logits, dim=-1)


_MASK64 = 2**64 - 1


def _mix64(value: int) -> int:
    """SplitMix64's finaliser: nearby (seed, position) pairs get unrelated generator seeds."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def gumbel_noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    """[vocab] float64 Gumbel(0, 1) noise for one position of one seeded sequence. Drawn on the
    CPU from a generator seeded by (seed, position), so every device and process gets the same
    noise; the verifier and the drafter share it without sending it."""
    generator = torch.Generator().manual_seed(_mix64(_mix64(seed) ^ position) >> 1)
    uniforms = torch.rand(vocab, generator=generator, dtype=torch.float64)
    return -torch.log(-torch.log(uniforms.clamp_min(2.0**-60)))


def coupled_tokens(logits: torch.Tensor, config: SamplingConfig,
                   positions: list[int]) -> torch.Tensor:
    """Gumbel-max sampling with shared noise: ``[n, vocab]`` logits -> ``[n]`` ids,
    argmax(log p + g_position) - an exact draw from the processed p. A drafter that uses the same
    noise proposes the target's own choice whenever its distribution is close: the coupling of
    Daliri et al. 2024 ("Coupling without communication and drafter-invariant speculative
    decoding"), so the output does not depend on the drafter, k or timing."""
    if config.coupling_seed is None:
        raise ValueError("coupled sampling needs a coupling_seed")
    logprobs = process_logits(logits, config).double()  # [n, vocab]
    noise = torch.stack([gumbel_noise(config.coupling_seed, p, logits.shape[-1])
                         for p in positions]).to(logprobs.device)  # [n, vocab]
    return torch.argmax(logprobs + noise, dim=-1)


def choose_tokens(logits: torch.Tensor, config: SamplingConfig,
                  positions: list[int]) -> torch.Tensor:
    """The target's token at each row in a deterministic mode (greedy or coupled)."""
    return (greedy_tokens(logits) if config.greedy
            else coupled_tokens(logits, config, positions))


def draw_uniforms(generator: torch.Generator, count: int) -> torch.Tensor:
    """[count] float64 uniforms in [0, 1) from an explicit generator."""
    return torch.rand(count, generator=generator, dtype=torch.float64)


def sample_from_probs(probs: torch.Tensor, uniform: float) -> int:
    """Inverse-CDF sample of one id from ``probs`` ([vocab], need not sum to 1) with ``uniform``.

    Zero-probability ids are never returned.
    """
    weights = probs.double().clamp_min(0.0)  # [vocab]
    cdf = torch.cumsum(weights, dim=0)  # [vocab]
    total = cdf[-1].item()
    if not total > 0.0:
        raise ValueError("cannot sample from an all-zero distribution")
    x = torch.tensor([uniform * total], dtype=cdf.dtype)
    index = int(torch.searchsorted(cdf, x, right=True).item())  # first id with cdf > x
    if index >= len(cdf):  # uniform * total rounded up to the total: take the last supported id
        index = int(torch.nonzero(weights > 0).flatten()[-1].item())
    return index


def sample_rows(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """:func:`sample_from_probs` row by row, on the rows' device: [n, vocab] weights, [n]
    float64 uniforms -> [n] ids (inverse CDF; zero-weight ids are never returned)."""
    weights = weights.double().clamp_min(0.0)
    cdf = torch.cumsum(weights, dim=-1)  # [n, vocab]
    x = uniforms * cdf[:, -1]  # [n]
    index = torch.searchsorted(cdf, x[:, None], right=True)[:, 0]  # first id with cdf > x
    vocab = weights.shape[-1]
    last_supported = vocab - 1 - torch.argmax((weights > 0).flip(-1).int(), dim=-1)
    return torch.where(index >= vocab, last_supported, index)
