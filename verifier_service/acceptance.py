"""Acceptance on the model's device, batched: every job of a forward in one vectorised step.

The host path (``shared.sampling.verify_block``, one job at a time) copies each job's k + 1
logits rows to the host in float32 - 600 KB per row for a 151,936-token vocabulary - and walks
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
sampling and sampled token trees. Terms as in ``shared.sampling``: *accepted* drafts passed the
ratio test, the *recovered* token comes from the residual, the *bonus* token when all passed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.logits import process_rows
from shared.sampling import BlockVerdict, SamplingConfig


@dataclass(frozen=True)
class AcceptTask:
    """What one job needs decided from its logits rows ([k + 1, vocab])."""

    draft_ids: list[int]  # [k]
    draft_logprobs: list[float] | None  # [k] log q_i(x_i); None for one-hot drafts
    log_uniforms: list[float]  # [k]
    final_uniform: float
    config: SamplingConfig  # greedy or plain sampling (never coupled)
    top_ids: int = 0  # also the top-n ids of every row


@dataclass(frozen=True)
class Decision:
    """The device's answer for one task: ``argmax`` ([k + 1]) in greedy mode, else ``verdict``."""

    argmax: torch.Tensor | None
    verdict: BlockVerdict | None
    top_ids: list[list[int]] | None


def top_ids(rows: torch.Tensor, n: int) -> list[list[int]]:
    """The best n ids of every row ([k + 1, vocab] logits) -> [k + 1][n], best first."""
    return torch.topk(rows.float(), min(n, rows.shape[-1])).indices.tolist()  # type: ignore[no-any-return]


def ratio_test(target_logprobs: torch.Tensor, draft_logprobs: torch.Tensor,
               log_uniforms: torch.Tensor) -> torch.Tensor:
    """[D] booleans: log u_i < log p_i(x_i) - log q_i(x_i) (log q = 0 for one-hot drafts)."""
    return log_uniforms < target_logprobs.double() - draft_logprobs


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
    """``shared.sampling.sample_from_probs`` row by row: [n, vocab] weights, [n] float64 uniforms
    -> [n] ids (inverse CDF; zero-weight ids are never returned)."""
    weights = weights.double().clamp_min(0.0)
    cdf = torch.cumsum(weights, dim=-1)  # [n, vocab]
    x = uniforms * cdf[:, -1]  # [n]
    index = torch.searchsorted(cdf, x[:, None], right=True)[:, 0]  # first id with cdf > x
    vocab = weights.shape[-1]
    last_supported = vocab - 1 - torch.argmax((weights > 0).flip(-1).int(), dim=-1)
    return torch.where(index >= vocab, last_supported, index)


def decide(rows: list[torch.Tensor], tasks: list[AcceptTask],
           together: int | None = None) -> list[Decision]:
    """rows[j]: task j's logits rows on the model's device ([k_j + 1, vocab]); one decision each.

    ``together``: sampled tasks decided in one step. Default: all of them on an accelerator; on
    a CPU as many as keep the stacked rows under ``CPU_BLOCK`` values, because there a block
    that stays in cache wins (16 jobs of Qwen's vocabulary stacked: twice as slow per job as
    one at a time; 16 jobs of a 16-token vocabulary: 3x faster stacked)."""
    decisions: list[Decision | None] = [None] * len(tasks)
    greedy = [j for j, task in enumerate(tasks) if task.config.greedy]
    sampled = [j for j, task in enumerate(tasks) if not task.config.greedy]
    if greedy:  # the argmax of every row, one small copy back
        argmax = torch.cat([torch.argmax(rows[j], dim=-1) for j in greedy]).cpu()  # [R]
        cursor = 0
        for j in greedy:
            n = rows[j].shape[0]
            decisions[j] = Decision(argmax[cursor:cursor + n], None, None)  # lowest id on ties
            cursor += n
    if sampled:
        for group in _groups(sampled, rows, together):
            verdicts = _decide_sampled([rows[j] for j in group], [tasks[j] for j in group])
            for j, verdict in zip(group, verdicts, strict=True):
                decisions[j] = Decision(None, verdict, None)
    top = [j for j, task in enumerate(tasks) if task.top_ids]
    for j in top:  # few callers ask; one topk each
        ids = top_ids(rows[j], tasks[j].top_ids)
        done = decisions[j]
        assert done is not None
        decisions[j] = Decision(done.argmax, done.verdict, ids)
    assert all(d is not None for d in decisions)  # every task is greedy or sampled
    return decisions  # type: ignore[return-value]


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


def _decide_sampled(rows: list[torch.Tensor], tasks: list[AcceptTask]) -> list[BlockVerdict]:
    device = rows[0].device
    jobs = len(tasks)
    lengths = [len(task.draft_ids) for task in tasks]  # k_j
    counts = [k + 1 for k in lengths]
    stacked = torch.cat(rows).float() if jobs > 1 else rows[0].float()  # [R, vocab]
    configs = [t.config for t, n in zip(tasks, counts, strict=True) for _ in range(n)]
    logprobs = process_rows(stacked, configs)  # [R, vocab]

    # The batch's layout, built on the host and sent in two copies (ints, floats):
    # D drafts in job order; ``grid`` [J, k_max + 1] points at each job's drafts, padded with D
    # (a sentinel that always fails), so a row's first failure is its number accepted.
    k_max, drafts = max(lengths), sum(lengths)
    first_row: list[int] = []
    first_draft: list[int] = []
    row_of_draft: list[int] = []
    grid: list[int] = []
    row = draft = 0
    for k in lengths:
        first_row.append(row)
        first_draft.append(draft)
        row_of_draft.extend(range(row, row + k))
        grid.extend([*range(draft, draft + k), *[drafts] * (k_max + 1 - k)])
        row, draft = row + k + 1, draft + k
    ints = torch.tensor([*row_of_draft, *(x for t in tasks for x in t.draft_ids), 0, *grid,
                         *first_row, *first_draft]).to(device)
    floats = torch.tensor([*(lp for t in tasks
                             for lp in (t.draft_logprobs or [0.0] * len(t.draft_ids))),
                           *(u for t in tasks for u in t.log_uniforms),
                           *(t.final_uniform for t in tasks)], dtype=torch.float64).to(device)
    row_of, draft_ids = ints[:drafts], ints[drafts:2 * drafts + 1]  # draft_ids ends in 0
    at = 2 * drafts + 1
    grid_t = ints[at:at + jobs * (k_max + 1)].view(jobs, k_max + 1)
    first_row_t = ints[at + jobs * (k_max + 1):at + jobs * (k_max + 2)]
    first_draft_t = ints[at + jobs * (k_max + 2):]
    draft_lp, log_u, uniforms = floats[:drafts], floats[drafts:2 * drafts], floats[2 * drafts:]

    # 1. The ratio test of every draft, all jobs at once: accept x_i while
    #    log u_i < log p_i(x_i) - log q_i(x_i) (log q = 0 for one-hot drafts).
    target_lp = logprobs[row_of, draft_ids[:drafts]]  # [D] float32
    passed = ratio_test(target_lp, draft_lp, log_u)  # [D]
    failed = torch.cat([~passed, passed.new_ones(1)])  # [D + 1], the sentinel fails
    accepted = torch.argmax(failed[grid_t].int(), dim=-1)  # [J] the first failure

    # 2. The next token from the stopping row: the bonus from p_{k+1}, the recovered token from
    #    p without a rejected one-hot draft; a rejected model draft's residual needs q_j, which
    #    only the client has, so its row goes back instead.
    stop_probs = logprobs[first_row_t + accepted].exp()  # [J, vocab] float32
    weights = stop_probs.double()
    one_hot = [t.draft_logprobs is None and bool(t.draft_ids) for t in tasks]
    if any(one_hot):  # rows whose one-hot draft was rejected take the residual
        rejected = grid_t.gather(1, accepted[:, None])[:, 0] < drafts  # [J] stopped on a draft
        if not all(one_hot):
            rejected = rejected & torch.tensor(one_hot).to(device)
        residual = remove_rejected(weights, draft_ids[first_draft_t + accepted])
        weights = torch.where(rejected[:, None], residual, weights)
    next_token = sample_rows(weights, uniforms)  # [J]

    # 3. One copy back: accepted, next token and every log p_i(x_i) (float64 holds them exactly).
    packed = torch.cat([accepted.double(), next_token.double(), target_lp.double()]).cpu()
    accepted_host = packed[:jobs].long().tolist()
    next_host = packed[jobs:2 * jobs].long().tolist()
    lp_host = packed[2 * jobs:].float()
    row_jobs = [j for j, (t, k) in enumerate(zip(tasks, lengths, strict=True))
                if t.draft_logprobs is not None and accepted_host[j] < k]
    row_host = dict(zip(row_jobs, stop_probs[row_jobs].cpu(), strict=True)) if row_jobs else {}
    verdicts = []
    for j, (k, start) in enumerate(zip(lengths, first_draft, strict=True)):
        lp = lp_host[start:start + k]
        if j in row_host:
            verdicts.append(BlockVerdict(accepted_host[j], lp, None, None, row_host[j]))
        else:
            verdicts.append(BlockVerdict(accepted_host[j], lp, None, next_host[j], None))
    return verdicts
