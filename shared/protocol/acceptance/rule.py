"""The acceptance rule, written once: which drafts of a block the target accepts, and what it
draws next. The verifier's reference path (:func:`verify_block`, :func:`verify_tree`: one block at
a time on the host), its batched path (``shared.protocol.acceptance.batched``) and the client's
check of
every verdict it gets back (:func:`accepted_by_rule`) all decide through the functions here:
:func:`ratio_test` for sampled chains, :func:`accept_greedy` for deterministic chains,
:func:`accept_tree` for trees. Terms as in ``shared.protocol.sampling``'s glossary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shared.protocol.sampling import (
    SamplingConfig,
    choose_tokens,
    process_logits,
    sample_from_probs,
)


def ratio_test(target_logprobs: torch.Tensor, draft_logprobs: torch.Tensor | None,
               log_uniforms: torch.Tensor) -> torch.Tensor:
    """[D] booleans: log u_i < log p_i(x_i) - log q_i(x_i) in float64 (log q = 0 for one-hot
    drafts: ``draft_logprobs`` None, or zeros)."""
    ratio = target_logprobs.double()
    if draft_logprobs is not None:
        ratio = ratio - draft_logprobs.double()
    return log_uniforms.double() < ratio


def accept_drafts(
    target_logprobs: torch.Tensor,  # [k] log p_i(x_i)
    draft_logprobs: torch.Tensor | None,  # [k] log q_i(x_i); None for one-hot drafts
    log_uniforms: torch.Tensor,  # [k] log u_i
) -> int:
    """Number of leading drafts that pass :func:`ratio_test`."""
    passed = ratio_test(target_logprobs, draft_logprobs, log_uniforms)  # [k]
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
class Block:
    """One drafted block as acceptance reads it, the same on both sides: the client builds it
    from its draft and its own uniforms and sends it (``VerifyRequest`` is its codec); the
    verifier decides it from the block's logits rows ([k + 1, vocab]; a tree's [N + 1, vocab]);
    the client checks the verdict against it. No drafts: a first token drawn from a prefill's
    last row."""

    draft_ids: list[int]  # [k] (a tree's [N] nodes)
    draft_logprobs: list[float] | None  # [k] log q_i(x_i); None for one-hot drafts
    log_uniforms: list[float]  # [k]
    final_uniform: float
    config: SamplingConfig
    position: int = 0  # the sequence index of row 0's token (coupled sampling's noise)
    tree_parents: list[int] | None = None  # the drafts form this tree below row 0's token
    top_ids: int = 0  # also the top-n ids of every row

    @property
    def on_device(self) -> bool:
        """Decided batched on the model's device; coupled sampling (noise drawn on the host)
        and sampled trees take the host path."""
        if self.config.coupled:
            return False
        return self.tree_parents is None or self.config.greedy


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


def accepted_by_rule(block: Block, target_logprobs: torch.Tensor | None,
                     target_argmax: list[int] | None) -> tuple[int, list[int] | None]:
    """The rule applied to ``block`` and the scores its verdict carries (what the client gets
    back: the target's log p of every draft when sampling, its choice at every row in the
    deterministic modes): (the number accepted, a tree's accepted path)."""
    config = block.config
    if block.tree_parents is not None:
        path, _ = accept_tree(
            block.tree_parents, block.draft_ids,
            None if config.deterministic else block.log_uniforms,
            None if config.deterministic or target_logprobs is None
            else target_logprobs.tolist(),
            target_argmax if config.deterministic else None)
        return len(path), path
    ids = torch.tensor(block.draft_ids, dtype=torch.long)  # [k]
    if config.deterministic:
        return accept_greedy(ids, torch.tensor(target_argmax or [], dtype=torch.long)), None
    scores = target_logprobs if target_logprobs is not None else torch.empty(0)
    draft_lp = (torch.tensor(block.draft_logprobs, dtype=torch.float64)
                if block.draft_logprobs is not None else None)
    return accept_drafts(scores, draft_lp,
                         torch.tensor(block.log_uniforms, dtype=torch.float64)), None
