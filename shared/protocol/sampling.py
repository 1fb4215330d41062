"""Sampling math for exact speculative decoding: pure functions of tensors and explicit randomness.

Glossary (as in vLLM's rejection sampler):
  * target distribution p: the target model's processed distribution at a position;
  * draft distribution q: the drafter's processed distribution at the same position;
  * **accepted** tokens: draft tokens that passed the ratio test ``log u < log p(x) - log q(x)``;
  * **recovered** token: drawn from ``norm(max(0, p - q))`` at the first rejected position;
  * **bonus** token: drawn from the target row after the last draft when every draft was accepted;
  * output tokens of a block = accepted + (recovered or bonus), so between 1 and k + 1.

Greedy decoding (temperature 0) is its own path: a draft is accepted while it equals the target's
argmax, and the recovered / bonus token is the argmax.

Deterministic drafts (n-gram, prompt lookup) have a one-hot q: the ratio test becomes
``log u < log p(x)`` and the residual is p with x removed, renormalised.

Randomness never comes from a global RNG: callers pass uniforms drawn from their own
``torch.Generator``; :func:`sample_from_probs` inverts the CDF with one uniform, so the server can
sample on the client's behalf with the client's randomness and get the client's answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.protocol import GREEDY_TEMPERATURE, NO_TOP_K, NO_TOP_P
from shared.protocol.logits import process_rows


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
