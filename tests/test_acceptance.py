"""The batched device acceptance (``decide`` in shared/protocol/acceptance.py) gives the host
path's results bit for bit: the same accepted counts, next tokens, log p_i(x_i) and rows, for
every mix of greedy and sampled jobs, one-hot and model drafts, top-k / top-p, in one batch."""

from __future__ import annotations

import random

import pytest
import torch

from shared.protocol.acceptance import Block, decide, verify_block
from shared.protocol.sampling import SamplingConfig, process_logits, process_rows

VOCAB = 50

CONFIGS = [
    SamplingConfig(),  # greedy
    SamplingConfig(temperature=1.0),
    SamplingConfig(temperature=0.7, top_k=5),
    SamplingConfig(temperature=1.3, top_p=0.8),
    SamplingConfig(temperature=0.5, top_k=12, top_p=0.9),
    SamplingConfig(temperature=1e-3),  # nearly greedy, but sampled
    SamplingConfig(temperature=1.0, top_k=1),
    SamplingConfig(temperature=2.0, top_p=0.05),
]


def random_task(rng: random.Random, gen: torch.Generator,
                config: SamplingConfig) -> tuple[torch.Tensor, Block]:
    """A job's logits and a draft that the target accepts part of the time: drafts are drawn
    from the target's own processed distribution (so acceptances happen), one-hot or not."""
    k = rng.choice([0, 1, 2, 4, 7])
    logits = torch.randn(k + 1, VOCAB, generator=gen) * rng.choice([0.5, 2.0, 6.0])
    if rng.random() < 0.3:  # exact ties at the top
        logits[:, 3] = logits[:, 7] = logits.max() + 1.0
    if config.greedy:
        best = logits.argmax(-1)
        drafts = [int(best[i]) if rng.random() < 0.7 else rng.randrange(VOCAB) for i in range(k)]
        return logits, Block(drafts, None, [], rng.random(), config, rng.choice([0, 3]))
    probs = process_logits(logits, config).exp()  # [k + 1, vocab]
    drafts = [int(torch.multinomial(probs[i].double(), 1, generator=gen)) if rng.random() < 0.8
              else rng.randrange(VOCAB) for i in range(k)]
    one_hot = rng.random() < 0.5
    draft_lp = None if one_hot else [math_log(rng.uniform(0.05, 1.0)) for _ in range(k)]
    log_u = [math_log(rng.random() or 1e-12) for _ in range(k)]
    return logits, Block(drafts, draft_lp, log_u, rng.random(), config, rng.choice([0, 2]))


def math_log(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float64).log())


def host_verdict(logits: torch.Tensor, task: Block):  # type: ignore[no-untyped-def]
    return verify_block(
        logits, torch.tensor(task.draft_ids, dtype=torch.long),
        torch.tensor(task.draft_logprobs, dtype=torch.float64)
        if task.draft_logprobs is not None else None,
        torch.tensor(task.log_uniforms, dtype=torch.float64), task.final_uniform, task.config)


def test_process_rows_is_process_logits_bit_for_bit() -> None:
    """Rows of different configs processed together equal each block processed alone."""
    gen = torch.Generator().manual_seed(0)
    sampled = [c for c in CONFIGS if not c.greedy]
    blocks = [torch.randn(3, VOCAB, generator=gen) * 4 for _ in sampled]
    mixed = process_rows(torch.cat(blocks), [c for c in sampled for _ in range(3)])
    alone = torch.cat([process_logits(b, c) for b, c in zip(blocks, sampled, strict=True)])
    assert torch.equal(mixed, alone)


@pytest.mark.parametrize("together", [1, 5, None])
@pytest.mark.parametrize("seed", range(4))
def test_device_decisions_equal_the_host_path(seed: int, together: int | None) -> None:
    """Decided one job at a time (the CPU default), in groups, and all at once (an
    accelerator's default): the same answers as the host path."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    configs = CONFIGS * 4  # every config, several times, in a random order
    rng.shuffle(configs)
    jobs = [random_task(rng, gen, config) for config in configs]
    decisions = decide([logits for logits, _ in jobs], [task for _, task in jobs],
                       together=together or len(jobs))
    on_host = decide([logits for logits, _ in jobs], [task for _, task in jobs], on_device=False)
    outcomes = set()
    for (logits, task), device, host_path in zip(jobs, decisions, on_host, strict=True):
        host = host_verdict(logits, task)
        assert host_path.num_accepted == host.num_accepted  # decide's host path: the reference
        assert host_path.next_token == host.next_token
        assert host_path.top_ids == device.top_ids
        if task.config.greedy:
            assert device.target_argmax is not None
            assert torch.equal(device.target_argmax, host.target_argmax)
            assert device.num_accepted == host.num_accepted
            assert device.next_token == host.next_token
            outcomes.add("greedy")
        else:
            assert device.num_accepted == host.num_accepted
            assert device.next_token == host.next_token
            assert host.target_logprobs is not None and device.target_logprobs is not None
            assert torch.equal(device.target_logprobs, host.target_logprobs)
            assert (device.row is None) == (host.row is None)
            if host.row is not None:
                assert device.row is not None and torch.equal(device.row, host.row)
            k = len(task.draft_ids)
            outcomes.add("all accepted" if host.num_accepted == k else
                         "row" if host.row is not None else "recovered")
        if task.top_ids:
            expected = torch.topk(logits, task.top_ids).indices.tolist()
            assert device.top_ids == expected
    assert outcomes == {"greedy", "all accepted", "row", "recovered"}  # every branch ran


def test_certain_one_hot_draft_rejected_by_rounding_falls_back_to_p() -> None:
    """p(x) = 1 and log u = 0 (u = 1 is impossible, but the test is '<'): rejected, and the
    residual is empty; both paths draw from p itself."""
    logits = torch.full((2, VOCAB), -1e4)
    logits[0, 9] = logits[1, 4] = 0.0  # rows 0 and 1 are certain of 9 and 4
    task = Block([9], None, [0.0], 0.5, SamplingConfig(temperature=1.0))
    [decision] = decide([logits], [task])
    host = host_verdict(logits, task)
    assert host.num_accepted == decision.num_accepted == 0
    assert host.next_token == decision.next_token == 9
