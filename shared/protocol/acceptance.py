"""The acceptance rule of speculative sampling, written once (Leviathan et al. 2023, Chen et al.
2023, Algorithm 1). Everything that decides which drafts of a block the target accepts, and what
it draws next, is in this module: the verifier's batched path (:func:`decide`), its reference on
the host (:func:`verify_block`, :func:`verify_tree`) and the client's check of every verdict it
gets back (:func:`accepted_by_rule`).

Glossary (as in vLLM's rejection sampler; terms from ``shared.protocol.sampling`` too):
  * target distribution p_i: the target's processed distribution after ``[last token, x_<i]``;
  * draft distribution q_i: the drafter's processed distribution at the same position (one-hot
    for deterministic drafts: n-gram, prompt lookup, token trees);
  * **accepted** tokens: drafts that passed the ratio test
    ``log u_i < log p_i(x_i) - log q_i(x_i)``;
  * **recovered** token: drawn from ``norm(max(0, p_j - q_j))`` at the first rejected position j;
  * **bonus** token: drawn from p_{k+1} when every draft was accepted;
  * output tokens of a block = accepted + recovered + bonus (one of the last two), so 1 to k + 1.

Algorithm 1, one block of k drafts (:func:`verify_block` is this, line by line)::

    target rows over [last token, x_1 .. x_k]              # [k + 1, vocab], ONE forward
    greedy (temperature 0), its own branch:
        accept x_i while x_i == argmax p_i; the next token is argmax p at the first mismatch
    sampled:
        for i in 1..k: accept x_i iff log u_i < log p_i(x_i) - log q_i(x_i)
        first rejection j: recovered ~ norm(max(0, p_j - q_j))   (one-hot q: p_j without x_j)
        all k accepted:    bonus ~ p_{k+1}

Every draw is the inverse CDF of one of the client's own uniforms
(``shared.protocol.sampling.sample_from_probs``), so the verifier draws what the client would.
The residual of a *model* draft needs q_j, which only the client has: the verifier sends p_j
back and the client draws the recovered token (:func:`recover_token`).

Sections: 1. a block and its verdict; 2. the rule; 3. one block on the host (the reference);
4. token trees; 5. the batched path, derived step by step from 3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from shared.protocol.logprobs import TokenLogprobs
    from shared.protocol.schema import RowMask

from shared.protocol.logprobs import output_logprobs
from shared.protocol.sampling import (
    SamplingConfig,
    choose_tokens,
    penalize,
    process_logits,
    process_rows,
    sample_from_probs,
    sample_rows,
)
from shared.protocol.transfer import to_device

# -- 1. a block and its verdict ----------------------------------------------------------------


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
    # the target's own log-probabilities of the block's output tokens and of their rows' best
    # ``logprobs`` alternatives (``shared.protocol.logprobs``); None: not asked
    logprobs: int | None = None
    # with penalties (``config.penalized``): each generated token's count among the committed
    # tokens up to row 0 (the last token included); the drafts before each row add theirs
    history: tuple[tuple[int, int], ...] = ()
    # structured output: the tokens the grammar allows at each row (``RowMask``, one per row)
    masks: tuple[RowMask, ...] | None = None
    # the masks decoded ([rows, vocab] bool), where the verifier decoded them on arrival
    keep: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def constrained(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows with every token the grammar refuses at -inf: the target's constrained
        distribution, once processed (its rows renormalise over what is left)."""
        assert self.masks is not None
        keep = self.keep if self.keep is not None else \
            torch.stack([mask.keep(rows.shape[-1]) for mask in self.masks])
        return rows.float().masked_fill(~keep.to(rows.device), float("-inf"))

    def penalized(self, rows: torch.Tensor) -> torch.Tensor:
        """The block's rows with its config's bias and penalties (``sampling.penalize``): row
        0 after the history, a draft's row after the drafts on its path too."""
        if self.tree_parents is None:
            before = [self.draft_ids[:i] for i in range(rows.shape[0])]
        else:
            paths: list[list[int]] = []
            for node, parent in enumerate(self.tree_parents):
                paths.append([*(paths[parent] if parent >= 0 else []), self.draft_ids[node]])
            before = [[], *paths][:rows.shape[0]]
        return penalize(rows, self.config, dict(self.history), before)

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
    logprobs: list[TokenLogprobs] | None = None  # per output token, when the block asked


# -- 2. the rule -------------------------------------------------------------------------------


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


def remove_rejected(weights: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """:func:`residual_without_token` row by row: p with each row's rejected one-hot draft
    removed, renormalised. weights: [n, vocab] float64; tokens: [n]."""
    n = torch.arange(weights.shape[0], device=weights.device)
    residual = weights.clone()
    residual[n, tokens] = (weights[n, tokens] - 1.0).clamp_min(0.0)
    total = residual.sum(dim=-1, keepdim=True)  # [n, 1]
    certain = ~(total > 0.0)  # only rounding rejected a draft of probability 1: p itself
    fallback = weights / weights.sum(dim=-1, keepdim=True)
    return torch.where(certain, fallback, residual / total)


# -- 3. one block on the host: the reference ---------------------------------------------------


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
    """The verifier's half of Algorithm 1: find the first rejection, draw what it can."""
    k = draft_ids.shape[0]
    # Greedy (and coupled sampling): accept while x_i is the target's choice; next = its choice.
    if config.deterministic:
        argmax = choose_tokens(target_logits, config, list(range(position, position + k + 1)))
        return chosen_verdict(draft_ids, argmax)

    # 1. Accept x_i while log u_i < log p_i(x_i) - log q_i(x_i).
    logprobs = process_logits(target_logits, config)  # [k + 1, vocab]
    target_lp = logprobs[torch.arange(k), draft_ids]  # [k] log p_i(x_i)
    accepted = accept_drafts(target_lp, draft_logprobs, log_uniforms)
    # 2. The next token from the row where the block stopped.
    probs = logprobs[accepted].exp()  # [vocab] p_{j}, or p_{k+1} when all passed
    if accepted == k:  # every draft accepted: the bonus token from p_{k+1}
        next_token: int | None = sample_from_probs(probs, final_uniform)
        row = None
    elif draft_logprobs is None:  # a one-hot draft rejected: recovered from p_j without x_j
        next_token = sample_from_probs(
            residual_without_token(probs, int(draft_ids[accepted].item())), final_uniform
        )
        row = None
    else:  # the residual norm(max(0, p_j - q_j)) needs q_j, which only the client has
        next_token, row = None, probs
    return Verdict(accepted, target_lp, None, next_token, row)


def recover_token(
    target_row: torch.Tensor,  # [vocab] processed target probs p_j
    draft_row: torch.Tensor,  # [vocab] processed draft probs q_j
    final_uniform: float,
) -> int:
    """The client's half after a model draft's rejection: the recovered token from
    norm(max(0, p_j - q_j))."""
    return sample_from_probs(residual_probs(target_row, draft_row), final_uniform)


def accepted_by_rule(block: Block,
                     verdict: Verdict) -> tuple[int, list[int] | None, int | None]:
    """The rule applied to ``block`` and the scores ``verdict`` carries (the target's log p of
    every draft when sampling, its choice at every row in the deterministic modes): (the number
    accepted, a tree's accepted path, and in the deterministic modes the next token - the
    target's choice where the walk stopped; None when sampling, where it is a draw)."""
    config, argmax = block.config, verdict.target_argmax
    if config.deterministic:
        assert argmax is not None
        if block.tree_parents is not None:
            path, _ = accept_tree(block.tree_parents, block.draft_ids, None,
                                  target_argmax=argmax.tolist())
            return len(path), path, int(argmax[path[-1] + 1 if path else 0].item())
        accepted = accept_greedy(torch.tensor(block.draft_ids, dtype=torch.long), argmax)
        return accepted, None, int(argmax[accepted].item())
    scores = verdict.target_logprobs if verdict.target_logprobs is not None else torch.empty(0)
    if block.tree_parents is not None:
        path, _ = accept_tree(block.tree_parents, block.draft_ids, block.log_uniforms,
                              scores.tolist())
        return len(path), path, None
    draft_lp = (torch.tensor(block.draft_logprobs, dtype=torch.float64)
                if block.draft_logprobs is not None else None)
    return accept_drafts(scores, draft_lp,
                         torch.tensor(block.log_uniforms, dtype=torch.float64)), None, None


# -- 4. token trees ----------------------------------------------------------------------------
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


# -- 5. the batched path: every block of one forward ---------------------------------------------
# The host path copies each block's k + 1 rows to the host in float32 (4 bytes a vocabulary
# entry a row) and walks them one block at a time. Here the rows stay where the forward left
# them and every block is decided in one vectorised step; what comes back is a handful of numbers
# a block, in one copy: greedy blocks (chains, trees, the first token of ``/v1/generate``) the
# argmax of every row; sampled chains the log p_i(x_i) of every draft, the number accepted and
# the next token, plus the row p_j of a rejected model draft. It is section 3's arithmetic in the
# same order (float64 shift and temperature, float32 top-k / top-p / log-softmax, float64 ratio
# test and inverse-CDF draw), so on one device its verdicts are the reference's bit for bit
# (``tests/test_acceptance.py``). Coupled sampling and sampled trees stay on the host.

CPU_BLOCK = 1 << 20  # logits values decided in one step on a CPU


def decide(rows: list[torch.Tensor], blocks: list[Block], on_device: bool = True,
           together: int | None = None) -> list[Verdict]:
    """rows[j]: block j's logits rows, where the forward left them; one verdict each.

    ``on_device``: the blocks that can be are decided batched next to the rows, the rest (and
    all of them without it) on the host, one at a time, by the reference (section 3).
    ``together``: sampled blocks decided in one step. Default: all of them on an accelerator;
    on a CPU as many as keep the stacked rows under ``CPU_BLOCK`` values, because there a block
    that stays in cache wins over one large stack."""
    raw = rows  # logprobs report the target's own distributions
    rows = [block.penalized(row) if block.config.penalized else row
            for row, block in zip(rows, blocks, strict=True)]
    rows = [block.constrained(row) if block.masks is not None else row
            for row, block in zip(rows, blocks, strict=True)]
    verdicts: list[Verdict | None] = [None] * len(blocks)
    device = [j for j, block in enumerate(blocks) if on_device and block.on_device]
    greedy = [j for j in device if blocks[j].config.greedy]
    sampled = [j for j in device if not blocks[j].config.greedy]
    if greedy:  # the argmax of every row, one small copy back
        argmax = torch.cat([torch.argmax(rows[j], dim=-1) for j in greedy]).cpu()  # [R]
        cursor = 0
        for j in greedy:
            n = rows[j].shape[0]
            verdicts[j] = _chosen(blocks[j], argmax[cursor:cursor + n])  # lowest id on ties
            cursor += n
    if sampled:
        for group in _groups(sampled, rows, together):
            decided = _decide_sampled([rows[j] for j in group], [blocks[j] for j in group])
            for j, verdict in zip(group, decided, strict=True):
                verdicts[j] = verdict
    done: list[Verdict] = []
    for j, block in enumerate(blocks):
        verdict = verdicts[j] or _on_host(rows[j].float().cpu(), block)
        if block.top_ids:  # few callers ask; one topk each
            verdict = replace(verdict, top_ids=top_ids(rows[j], block.top_ids))
        if block.logprobs is not None:
            verdict = replace(verdict, logprobs=output_logprobs(raw[j], block, verdict))
        done.append(verdict)
    return done


def top_ids(rows: torch.Tensor, n: int) -> list[list[int]]:
    """The best n ids of every row ([k + 1, vocab] logits) -> [k + 1][n], best first."""
    return torch.topk(rows.float(), min(n, rows.shape[-1])).indices.tolist()  # type: ignore[no-any-return]


def _chosen(block: Block, argmax: torch.Tensor) -> Verdict:
    if block.tree_parents is not None:
        return chosen_tree_verdict(block.tree_parents, block.draft_ids, argmax)
    return chosen_verdict(torch.tensor(block.draft_ids, dtype=torch.long), argmax)


def _on_host(rows: torch.Tensor, block: Block) -> Verdict:
    """The reference path: rows [n, vocab] float32 on the host."""
    if block.tree_parents is not None:
        return verify_tree(rows, block.draft_ids, block.tree_parents, block.log_uniforms,
                           block.final_uniform, block.config, block.position)
    draft_lp = (torch.tensor(block.draft_logprobs, dtype=torch.float64)
                if block.draft_logprobs is not None else None)
    return verify_block(rows, torch.tensor(block.draft_ids, dtype=torch.long), draft_lp,
                        torch.tensor(block.log_uniforms, dtype=torch.float64),
                        block.final_uniform, block.config, block.position)


def _groups(jobs: list[int], rows: list[torch.Tensor], together: int | None) -> list[list[int]]:
    if together is not None:
        return [jobs[at:at + together] for at in range(0, len(jobs), together)]
    if rows[jobs[0]].device.type != "cpu":
        return [jobs]
    groups: list[list[int]] = [[]]
    size = 0
    for j in jobs:
        if groups[-1] and size + rows[j].numel() > CPU_BLOCK:
            groups.append([])
            size = 0
        groups[-1].append(j)
        size += rows[j].numel()
    return groups


@dataclass(frozen=True)
class SampledLayout:
    """Where each sampled block's pieces sit in the stacked batch, on the model's device.

    The batch stacks J blocks' rows: block j has k_j drafts and k_j + 1 rows, R rows and D
    drafts in all. Built on the host and sent in two copies (one of integers, one of floats).
    """

    draft_rows: torch.Tensor  # [D] the row that scores each draft
    draft_ids: torch.Tensor  # [D + 1] every draft's token, then a 0 for the sentinel
    # [J, k_max + 1] the index of each block's drafts into the D drafts, padded with D (the
    # sentinel, which always fails): a block's first failure is its number accepted
    grid: torch.Tensor
    first_row: torch.Tensor  # [J] each block's first row
    first_draft: torch.Tensor  # [J] each block's first draft
    one_hot: torch.Tensor  # [J] bool: the block's drafts are one-hot (no draft log-probs)
    draft_logprobs: torch.Tensor  # [D] float64 log q_i(x_i) (0 for one-hot drafts)
    log_uniforms: torch.Tensor  # [D] float64
    final_uniforms: torch.Tensor  # [J] float64

    @classmethod
    def build(cls, blocks: list[Block], device: torch.device) -> SampledLayout:
        lengths = [len(block.draft_ids) for block in blocks]  # k_j
        jobs, k_max, drafts = len(blocks), max(lengths), sum(lengths)
        first_row: list[int] = []
        first_draft: list[int] = []
        draft_rows: list[int] = []
        grid: list[int] = []
        row = draft = 0
        for k in lengths:
            first_row.append(row)
            first_draft.append(draft)
            draft_rows.extend(range(row, row + k))
            grid.extend([*range(draft, draft + k), *[drafts] * (k_max + 1 - k)])
            row, draft = row + k + 1, draft + k
        one_hot = [int(c.draft_logprobs is None and bool(c.draft_ids)) for c in blocks]
        ints = to_device([*draft_rows, *(x for c in blocks for x in c.draft_ids), 0, *grid,
                          *first_row, *first_draft, *one_hot], torch.long, device)
        floats = to_device([*(lp for c in blocks
                              for lp in (c.draft_logprobs or [0.0] * len(c.draft_ids))),
                            *(u for c in blocks for u in c.log_uniforms),
                            *(c.final_uniform for c in blocks)], torch.float64, device)
        ints_at = torch.split(ints, [drafts, drafts + 1, jobs * (k_max + 1), jobs, jobs, jobs])
        floats_at = torch.split(floats, [drafts, drafts, jobs])
        return cls(ints_at[0], ints_at[1], ints_at[2].view(jobs, k_max + 1), ints_at[3],
                   ints_at[4], ints_at[5].bool(), *floats_at)


def _decide_sampled(rows: list[torch.Tensor], blocks: list[Block]) -> list[Verdict]:
    """Section 3's steps 1 and 2 for every sampled chain of ``rows`` at once."""
    jobs = len(blocks)
    lengths = [len(block.draft_ids) for block in blocks]  # k_j
    stacked = torch.cat(rows).float() if jobs > 1 else rows[0].float()  # [R, vocab]
    configs = [c.config for c, k in zip(blocks, lengths, strict=True) for _ in range(k + 1)]
    logprobs = process_rows(stacked, configs)  # [R, vocab]
    at = SampledLayout.build(blocks, rows[0].device)
    drafts = at.draft_rows.shape[0]

    # 1. Accept x_i while log u_i < log p_i(x_i) - log q_i(x_i), every block at once (log q = 0
    #    for one-hot drafts); a block's number accepted is its first failure.
    target_lp = logprobs[at.draft_rows, at.draft_ids[:drafts]]  # [D] float32
    passed = ratio_test(target_lp, at.draft_logprobs, at.log_uniforms)  # [D]
    failed = torch.cat([~passed, passed.new_ones(1)])  # [D + 1], the sentinel fails
    accepted = torch.argmax(failed[at.grid].int(), dim=-1)  # [J] the first failure

    # 2. The next token from the row where each block stopped: the bonus from p_{k+1}, the
    #    recovered token from p_j without a rejected one-hot draft; a rejected model draft's
    #    residual needs q_j, which only the client has, so its row goes back instead.
    stop_probs = logprobs[at.first_row + accepted].exp()  # [J, vocab] float32
    weights = stop_probs.double()
    one_hot = [c.draft_logprobs is None and bool(c.draft_ids) for c in blocks]
    if any(one_hot):  # rows whose one-hot draft was rejected take the residual
        rejected = at.grid.gather(1, accepted[:, None])[:, 0] < drafts  # [J] stopped on a draft
        if not all(one_hot):
            rejected = rejected & at.one_hot
        residual = remove_rejected(weights, at.draft_ids[at.first_draft + accepted])
        weights = torch.where(rejected[:, None], residual, weights)
    next_token = sample_rows(weights, at.final_uniforms)  # [J]

    # 3. One copy back: accepted, next token and every log p_i(x_i) (float64 holds them exactly).
    packed = torch.cat([accepted.double(), next_token.double(), target_lp.double()]).cpu()
    accepted_host = packed[:jobs].long().tolist()
    next_host = packed[jobs:2 * jobs].long().tolist()
    lp_host = packed[2 * jobs:].float()
    row_jobs = [j for j, (c, k) in enumerate(zip(blocks, lengths, strict=True))
                if c.draft_logprobs is not None and accepted_host[j] < k]
    row_host = dict(zip(row_jobs, stop_probs[row_jobs].cpu(), strict=True)) if row_jobs else {}
    verdicts = []
    start = 0
    for j, k in enumerate(lengths):
        lp = lp_host[start:start + k]
        start += k
        if j in row_host:
            verdicts.append(Verdict(accepted_host[j], lp, None, None, row_host[j]))
        else:
            verdicts.append(Verdict(accepted_host[j], lp, None, next_host[j]))
    return verdicts
