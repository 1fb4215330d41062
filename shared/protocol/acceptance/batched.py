"""Acceptance on the model's device, batched: every job of a forward in one vectorised step.

The host path (``shared.protocol.acceptance.rule.verify_block``, one job at a time) copies each
job's k + 1
logits rows to the host in float32 - 4 bytes per vocabulary entry per row - and walks
them with per-job Python. Here the rows stay where the forward left them; what comes back is a
handful of numbers per job, in one copy:

* greedy jobs (chains, trees, the first token of ``/v1/generate``): the argmax of every row;
* sampled chain jobs: the processed log p_i(x_i) of every draft, the number accepted and the
  recovered / bonus token, drawn with the client's own uniform; plus, for a sampled *model* draft
  that was rejected, the one target row the client needs for its residual.

Everything is the host path's arithmetic in the same order (float64 shift and temperature,
float32 top-k / top-p / log-softmax, float64 ratio test and inverse-CDF draw), so on one device
the results are the host path's bit for bit (``tests/test_acceptance.py`` holds them to it); the
host path stays as the reference and for what this one does not cover: coupled (reproducible)
sampling and sampled token trees. Terms as in ``shared.protocol.sampling``: *accepted* drafts
passed the
ratio test, the *recovered* token comes from the residual, the *bonus* token when all passed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from shared.protocol.acceptance import rule
from shared.protocol.acceptance.rule import (
    Block,
    Verdict,
    chosen_tree_verdict,
    chosen_verdict,
    verify_block,
    verify_tree,
)
from shared.protocol.logits import process_rows
from shared.protocol.transfer import to_device


def top_ids(rows: torch.Tensor, n: int) -> list[list[int]]:
    """The best n ids of every row ([k + 1, vocab] logits) -> [k + 1][n], best first."""
    return torch.topk(rows.float(), min(n, rows.shape[-1])).indices.tolist()  # type: ignore[no-any-return]


def remove_rejected(weights: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The residual of a rejected one-hot draft: p with the draft's token removed, renormalised
    (``residual_without_token`` row by row). weights: [n, vocab] float64; tokens: [n]."""
    n = torch.arange(weights.shape[0], device=weights.device)
    residual = weights.clone()
    residual[n, tokens] = (weights[n, tokens] - 1.0).clamp_min(0.0)
    total = residual.sum(dim=-1, keepdim=True)  # [n, 1]
    certain = ~(total > 0.0)  # only rounding rejected a draft of probability 1: p itself
    fallback = weights / weights.sum(dim=-1, keepdim=True)
    return torch.where(certain, fallback, residual / total)


def sample_rows(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """``shared.protocol.sampling.sample_from_probs`` row by row: [n, vocab] weights, [n] float64
    uniforms
    -> [n] ids (inverse CDF; zero-weight ids are never returned)."""
    weights = weights.double().clamp_min(0.0)
    cdf = torch.cumsum(weights, dim=-1)  # [n, vocab]
    x = uniforms * cdf[:, -1]  # [n]
    index = torch.searchsorted(cdf, x[:, None], right=True)[:, 0]  # first id with cdf > x
    vocab = weights.shape[-1]
    last_supported = vocab - 1 - torch.argmax((weights > 0).flip(-1).int(), dim=-1)
    return torch.where(index >= vocab, last_supported, index)


def decide(rows: list[torch.Tensor], blocks: list[Block], on_device: bool = True,
           together: int | None = None) -> list[Verdict]:
    """rows[j]: block j's logits rows, where the forward left them; one verdict each.

    ``on_device``: the blocks that can be are decided batched next to the rows, the rest (and
    all of them without it) on the host, one at a time, by the reference functions of
    ``shared.protocol.acceptance.rule``. ``together``: sampled blocks decided in one step. Default:
    all
    of them on an accelerator; on a CPU as many as keep the stacked rows under ``CPU_BLOCK``
    values, because there a block that stays in cache wins over one large stack."""
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
        done.append(verdict)
    return done


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


CPU_BLOCK = 1 << 20  # logits values decided in one step on a CPU


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
        ints_at = _cuts(ints, [drafts, drafts + 1, jobs * (k_max + 1), jobs, jobs, jobs])
        floats_at = _cuts(floats, [drafts, drafts, jobs])
        return cls(ints_at[0], ints_at[1], ints_at[2].view(jobs, k_max + 1), ints_at[3],
                   ints_at[4], ints_at[5].bool(), *floats_at)


def _cuts(values: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(torch.split(values, sizes))


def _decide_sampled(rows: list[torch.Tensor], blocks: list[Block]) -> list[Verdict]:
    jobs = len(blocks)
    lengths = [len(block.draft_ids) for block in blocks]  # k_j
    stacked = torch.cat(rows).float() if jobs > 1 else rows[0].float()  # [R, vocab]
    configs = [c.config for c, k in zip(blocks, lengths, strict=True) for _ in range(k + 1)]
    logprobs = process_rows(stacked, configs)  # [R, vocab]
    at = SampledLayout.build(blocks, rows[0].device)
    drafts = at.draft_rows.shape[0]

    # 1. The ratio test of every draft, all blocks at once: accept x_i while
    #    log u_i < log p_i(x_i) - log q_i(x_i) (log q = 0 for one-hot drafts).
    target_lp = logprobs[at.draft_rows, at.draft_ids[:drafts]]  # [D] float32
    passed = rule.ratio_test(target_lp, at.draft_logprobs, at.log_uniforms)  # [D]
    failed = torch.cat([~passed, passed.new_ones(1)])  # [D + 1], the sentinel fails
    accepted = torch.argmax(failed[at.grid].int(), dim=-1)  # [J] the first failure

    # 2. The next token from the stopping row: the bonus from p_{k+1}, the recovered token from
    #    p without a rejected one-hot draft; a rejected model draft's residual needs q_j, which
    #    only the client has, so its row goes back instead.
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
