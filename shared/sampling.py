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

import math
from dataclasses import dataclass

import torch

from shared.logits import process_rows


@dataclass(frozen=True)
class SamplingConfig:
    """Logit processing applied to both the target and the draft distributions.

    temperature 0 means greedy; top_k 0 and top_p 1.0 mean "no truncation".
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
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


def accept_drafts(
    target_logprobs: torch.Tensor,  # [k] log p_i(x_i)
    draft_logprobs: torch.Tensor | None,  # [k] log q_i(x_i); None for one-hot drafts
    log_uniforms: torch.Tensor,  # [k] log u_i
) -> int:
    """Number of leading drafts that pass ``log u_i < log p_i(x_i) - log q_i(x_i)``."""
    ratio = target_logprobs.double()
    if draft_logprobs is not None:
        ratio = ratio - draft_logprobs.double()
    passed = log_uniforms.double() < ratio  # [k]
    rejected = torch.nonzero(~passed)
    return int(rejected[0].item()) if len(rejected) else len(passed)


def accept_greedy(draft_ids: torch.Tensor, target_argmax: torch.Tensor) -> int:
    """Leading drafts equal to the target argmax. draft_ids: [k]; target_argmax: [>= k]."""
    k = draft_ids.shape[0]
    mismatch = torch.nonzero(draft_ids != target_argmax[:k])
    return int(mismatch[0].item()) if len(mismatch) else k


def residual_probs(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over [vocab]; the recovered token's distribution.

    If p <= q everywhere (only possible through rounding, since a rejection needs p(x) < q(x)
    somewhere), p itself is returned, which is then the correct conditional.
    """
    residual = (target_probs.double() - draft_probs.double()).clamp_min(0.0)  # [vocab]
    total = residual.sum()
    if not total > 0.0:
        return target_probs.double() / target_probs.double().sum()
    return residual / total


def residual_without_token(target_probs: torch.Tensor, token: int) -> torch.Tensor:
    """Residual for a one-hot draft: p with ``token`` removed, renormalised. [vocab] -> [vocab]."""
    one_hot = torch.zeros_like(target_probs, dtype=torch.float64)
    one_hot[token] = 1.0
    return residual_probs(target_probs, one_hot)


@dataclass(frozen=True)
class Verdict:
    """The verifier's reading of one drafted block: a chain or a token tree.

    num_accepted: drafts accepted (a tree's: the nodes on ``path``). next_token: the recovered or
    bonus token when it could be drawn without the draft distribution (greedy, one-hot drafts,
    all accepted, every tree); otherwise None, and ``row`` holds the target's processed probs at
    the rejected position ([vocab]).
    """

    num_accepted: int
    # processed log p of every draft given what precedes it: a chain's [k] log p_i(x_i), a
    # tree's [N] log p_parent(node); None in the deterministic modes
    target_logprobs: torch.Tensor | None
    target_argmax: torch.Tensor | None  # [k + 1] (a tree's [N + 1]); deterministic modes only
    next_token: int | None
    row: torch.Tensor | None = None  # [vocab] probs at the rejected position (chains only)
    path: list[int] | None = None  # a tree's accepted nodes, root's child first
    top_ids: list[list[int]] | None = None  # the target's best ids of every row, when asked


def chosen_verdict(draft_ids: torch.Tensor, target_argmax: torch.Tensor) -> Verdict:
    """A deterministic mode's verdict from the target's choice at every row.
    draft_ids: [k]; target_argmax: [k + 1]."""
    accepted = accept_greedy(draft_ids, target_argmax)
    return Verdict(accepted, None, target_argmax, int(target_argmax[accepted].item()))


def verify_block(
    target_logits: torch.Tensor,  # [k + 1, vocab] raw logits over [last token, x_1 .. x_k]
    draft_ids: torch.Tensor,  # [k]
    draft_logprobs: torch.Tensor | None,  # [k]; None for one-hot drafts
    log_uniforms: torch.Tensor,  # [k]
    final_uniform: float,
    config: SamplingConfig,
    position: int = 0,  # the sequence index of row 0's token (coupled sampling)
) -> Verdict:
    """The verifier's half of a speculative step: find the first rejection, draw what it can."""
    k = draft_ids.shape[0]
    if config.deterministic:
        argmax = choose_tokens(target_logits, config, list(range(position, position + k + 1)))
        return chosen_verdict(draft_ids, argmax)

    logprobs = process_logits(target_logits, config)  # [k + 1, vocab]
    target_lp = logprobs[torch.arange(k), draft_ids]  # [k] log p_i(x_i)
    accepted = accept_drafts(target_lp, draft_logprobs, log_uniforms)
    probs = logprobs[accepted].exp()  # [vocab] target row at the stopping position
    if accepted == k:  # every draft accepted: bonus token from p_{k+1}
        next_token: int | None = sample_from_probs(probs, final_uniform)
        row = None
    elif draft_logprobs is None:  # one-hot draft rejected: recovered from p without the draft
        next_token = sample_from_probs(
            residual_without_token(probs, int(draft_ids[accepted].item())), final_uniform
        )
        row = None
    else:  # the residual needs q_j, which only the client has: send p_j
        next_token, row = None, probs
    return Verdict(accepted, target_lp, None, next_token, row)


def recover_token(
    target_row: torch.Tensor,  # [vocab] processed target probs p_j
    draft_row: torch.Tensor,  # [vocab] processed draft probs q_j
    final_uniform: float,
) -> int:
    """The client's half after a rejection: recovered token from norm(max(0, p_j - q_j))."""
    return sample_from_probs(residual_probs(target_row, draft_row), final_uniform)


# -- token trees -------------------------------------------------------------------------------
# A tree of N draft nodes hangs below the last committed token (the root). ``parents[i]`` is node
# i's parent: -1 for the root, else an earlier node (parents[i] < i), so the nodes are in
# topological order and siblings in the drafter's order of preference. Row 0 of the target's
# logits follows the root, row i + 1 follows node i. Tree nodes are one-hot (deterministic)
# candidates: greedy follows the argmax; sampling tests a node's children one after another
# *without replacement* - child c is accepted with probability p'(c), where p' is p with the
# children already rejected removed and renormalised - and when every child is rejected the next
# token is drawn from that p'. Each child is then output with probability exactly p(c), and any
# other token with p(t): the multi-candidate rule of SpecInfer (Miao et al. 2024, "SpecInfer",
# multi-step speculative sampling) for one-hot drafts, also in Jeon et al. 2024 ("Recursive
# speculative decoding"). Testing each child against the untouched p instead outputs the second
# child with probability p(c2)(1 - p(c1)) / ... wrongly; the distribution tests use that as their
# negative control.


def tree_depths(parents: list[int]) -> list[int]:
    """Depth of every node (a child of the root has depth 1)."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


def tree_children(parents: list[int]) -> list[list[int]]:
    """children[0] holds the root's children, children[i + 1] node i's, in order."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for node, parent in enumerate(parents):
        children[parent + 1].append(node)
    return children


def accept_tree(
    parents: list[int],
    draft_ids: list[int],
    log_uniforms: list[float] | None,  # [N], one per node; None in greedy mode
    node_logprobs: list[float] | None = None,  # [N] log p_parent(node's token); sampling
    target_argmax: list[int] | None = None,  # [N + 1] argmax of every row; greedy
) -> tuple[list[int], list[int]]:
    """Walk the tree: the accepted path (node ids, root's child first) and the tokens rejected
    at the node where the walk stopped (removed from p' before the next token is drawn)."""
    children = tree_children(parents)
    path: list[int] = []
    here = -1  # the root
    while True:
        rejected: list[int] = []
        chosen = None
        if target_argmax is not None:
            best = target_argmax[here + 1]
            chosen = next((c for c in children[here + 1] if draft_ids[c] == best), None)
        else:
            assert node_logprobs is not None and log_uniforms is not None
            removed = 0.0  # p-mass of the rejected children
            for child in children[here + 1]:
                token = draft_ids[child]
                if token in rejected:  # a duplicate: p'(token) is 0 now
                    continue
                remaining = 1.0 - removed
                logp = node_logprobs[child]
                if remaining > 0.0 and log_uniforms[child] < logp - math.log(remaining):
                    chosen = child
                    break
                rejected.append(token)
                removed += math.exp(logp)
        if chosen is None:
            return path, rejected
        path.append(chosen)
        here = chosen


def chosen_tree_verdict(parents: list[int], draft_ids: list[int],
                        target_argmax: torch.Tensor) -> Verdict:
    """A deterministic mode's tree verdict: follow the target's choice ([N + 1], one per row)."""
    path, _ = accept_tree(parents, draft_ids, None, target_argmax=target_argmax.tolist())
    stop = path[-1] + 1 if path else 0
    return Verdict(len(path), None, target_argmax, int(target_argmax[stop].item()), path=path)


def verify_tree(
    target_logits: torch.Tensor,  # [N + 1, vocab]: row 0 after the root, row i + 1 after node i
    draft_ids: list[int],  # [N]
    parents: list[int],  # [N]
    log_uniforms: list[float],  # [N]
    final_uniform: float,
    config: SamplingConfig,
    position: int = 0,  # the sequence index of row 0's token (coupled sampling)
) -> Verdict:
    """The verifier's half for a tree of one-hot drafts: the longest accepted path and the next
    token, drawn with the client's ``final_uniform``."""
    if config.deterministic:
        rows = [position, *(position + d for d in tree_depths(parents))]
        return chosen_tree_verdict(parents, draft_ids, choose_tokens(target_logits, config, rows))
    logprobs = process_logits(target_logits, config)  # [N + 1, vocab]
    parent_rows = torch.tensor([p + 1 for p in parents], dtype=torch.long)  # [N]
    node_lp = logprobs[parent_rows, torch.tensor(draft_ids, dtype=torch.long)].double()  # [N]
    path, rejected = accept_tree(parents, draft_ids, log_uniforms, node_lp.tolist())
    probs = logprobs[path[-1] + 1 if path else 0].double().exp()  # [vocab]
    if rejected:
        kept = probs.clone()
        kept[torch.tensor(rejected, dtype=torch.long)] = 0.0
        if kept.sum() > 0.0:  # else only rounding rejected a certain child: p is the answer
            probs = kept
    return Verdict(len(path), node_lp, None, sample_from_probs(probs, final_uniform), path=path)
