"""Model-free drafters and draft-length policies, on hand-built sequences."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from drafter_client.draft_length import (
    PROBE_SHARE,
    CostModelLength,
    FixedLength,
    HeuristicLength,
    make_draft_length,
)
from drafter_client.hybrid import COPY_PRIOR, LOOKUP_PRIOR, HybridDrafter, trust_class
from drafter_client.model_free import (
    BigramDrafter,
    NGramDrafter,
    PromptLookupDrafter,
    special_ids,
)
from shared.engines.drafter import Drafter
from shared.protocol.sampling import SamplingConfig
from tests.support.outcomes import observed

GREEDY, GEN = SamplingConfig(), torch.Generator()


def propose(drafter, k: int) -> list[int]:  # type: ignore[no-untyped-def]
    draft = drafter.propose(k, GREEDY, GEN)
    assert draft.logprobs is None and draft.probs is None  # one-hot: nothing to send
    return list(draft.ids)


def test_simple_ngram_follows_the_prompt() -> None:
    drafter = NGramDrafter(n=3, kind="simple")
    drafter.reset([1, 2, 3, 4, 1, 2])
    assert propose(drafter, 3) == [3, 4, 1]  # (1,2)->3, (2,3)->4, (3,4)->1


def test_simple_ngram_pads_or_stops_at_unknown_context() -> None:
    padded = NGramDrafter(n=3, kind="simple")
    padded.reset([1, 2, 3, 9])
    assert propose(padded, 2) == [9, 9]  # (3,9) unknown: pad with the last token
    stopping = NGramDrafter(n=3, kind="simple", stop_if_unknown=True)
    stopping.reset([1, 2, 3, 9])
    assert propose(stopping, 2) == []


def test_multi_ngram_falls_back_to_shorter_contexts() -> None:
    drafter = NGramDrafter(n=3, kind="multi", stop_if_unknown=True)
    drafter.reset([5, 7, 1, 2, 8, 7])
    # (8,7) is unknown; the bigram context (7,) -> 1, then (7,1) -> 2, then (1,2) -> 8
    assert propose(drafter, 3) == [1, 2, 8]


def test_ngram_learns_emitted_tokens_and_prefers_frequent_then_recent() -> None:
    drafter = NGramDrafter(n=2, kind="simple", stop_if_unknown=True)
    drafter.reset([1, 2, 1, 3])
    assert propose(drafter, 1) == []  # nothing follows 3 yet
    drafter.commit([1, 3])  # 1 -> 3 seen twice now, 1 -> 2 once
    drafter.commit([1])
    assert propose(drafter, 1) == [3]
    drafter.reset([1, 2, 1, 3, 3])
    drafter.commit([1])
    assert propose(drafter, 1) == [3]  # tie 1->2 / 1->3: the most recent wins


def test_ngram_top_k_filler_is_used_after_the_pool() -> None:
    drafter = NGramDrafter(n=2, kind="simple", top_k_filler=2,
                                        stop_if_unknown=True)
    drafter.reset([4, 5])
    assert propose(drafter, 1) == []
    drafter.observe_top_k([4, 5], [6, 7])  # the target ranks 6 first after ...5
    assert propose(drafter, 1) == [6]
    drafter.commit([7])  # the target emitted 7 after 5: the pool wins over the filler
    drafter.reset([4, 5, 7, 4, 5])
    drafter.observe_top_k([4, 5], [6])
    assert propose(drafter, 1) == [7]


def test_prompt_lookup_proposes_what_followed_the_latest_match() -> None:
    drafter = PromptLookupDrafter(min_ngram=1, max_ngram=3)
    drafter.reset([1, 2, 3, 4, 5, 9, 1, 2, 3])
    assert propose(drafter, 3) == [4, 5, 9]
    drafter.reset([1, 2, 3, 6, 8, 2, 3])  # (2,3) matched at the most recent place: 6, 8
    assert propose(drafter, 2) == [6, 8]
    drafter.reset([1, 2, 3])
    assert propose(drafter, 2) == []  # no earlier match


def test_prompt_lookup_prefers_the_longest_match_over_a_more_recent_one() -> None:
    sequence = [1, 2, 3, 10, 11, 8, 3, 20, 1, 2, 3]  # "1 2 3" at 0, a lone "3" at 6
    longest = PromptLookupDrafter(min_ngram=1, max_ngram=12)
    longest.reset(sequence)
    assert propose(longest, 2) == [10, 11] and longest.matched == 3
    shortest = PromptLookupDrafter(min_ngram=1, max_ngram=1)
    shortest.reset(sequence)
    assert propose(shortest, 2) == [20, 1] and shortest.matched == 1
    strict = PromptLookupDrafter(min_ngram=4, max_ngram=12)
    strict.reset(sequence)
    assert propose(strict, 2) == [] and strict.matched == 0
    longest.commit([10])  # the tail moves on: "1 2 3 10" matched, 4 tokens
    assert propose(longest, 3) == [11, 8, 3] and longest.matched == 4


def test_prompt_lookup_copies_from_a_longer_match_in_the_source() -> None:
    drafter = PromptLookupDrafter(min_ngram=1, max_ngram=8)
    drafter.reset([7, 5, 6, 1, 2], encoder_ids=[9, 1, 2, 3, 4])  # "1 2" only in the source
    drafter.commit([])
    assert propose(drafter, 2) == [3, 4] and drafter.matched == 2


def test_prompt_lookup_stops_before_the_prompts_control_tokens() -> None:
    """A snippet quoted in a chat prompt is followed there by the end-of-turn and the next
    turn's marker (99, 98 here); the answer that copies the snippet goes on with its own text,
    so the copy is proposed up to those tokens only, and not at all where one comes next."""
    snippet = [5, 6, 7, 8]
    drafter = PromptLookupDrafter(min_ngram=1, max_ngram=12, stop_ids={98, 99})
    drafter.reset([98, 3, *snippet, 99, 98, 4, 5, 6])  # the answer has begun the copy
    assert propose(drafter, 8) == [7, 8] and drafter.matched == 2  # "5 6"
    drafter.commit([7, 8])
    assert propose(drafter, 8) == [] and drafter.matched == 0  # only markers would follow
    plain = PromptLookupDrafter(min_ngram=1, max_ngram=12)  # no stop ids: copies into them
    plain.reset([98, 3, *snippet, 99, 98, 4, 5, 6])
    assert propose(plain, 4) == [7, 8, 99, 98]


def test_special_ids_are_the_tokenizers_control_tokens(tiny_models: dict[str, Any]) -> None:
    from shared.models.catalog import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_models["gpt2-target"]))
    ids = special_ids(tokenizer)
    assert tokenizer.eos_token_id in ids and tokenizer.convert_tokens_to_ids("<unk>") in ids
    assert all(not tokenizer.convert_ids_to_tokens(i).isalpha() for i in ids)  # no words
    assert special_ids(object()) == frozenset()


class ZeroModel(Drafter):
    """A stand-in for the hybrid's model drafter: drafts k zeros, at no cost."""

    name = "m"

    def reset(self, prompt_ids: list[int], encoder_ids: list[int] | None = None) -> None:
        pass

    def propose(self, k: int, config: SamplingConfig, generator: torch.Generator) -> Any:
        from shared.engines.drafter import Draft
        return Draft([0] * k, None, None)

    def commit(self, tokens: list[int]) -> None:
        pass


def test_the_hybrid_trusts_each_match_length_by_its_own_record() -> None:
    assert [trust_class(m) for m in (0, 1, 2, 3, 4, 7, 8, 30)] == [1, 1, 2, 3, 4, 4, 8, 8]
    hybrid = HybridDrafter(ZeroModel(), PromptLookupDrafter(1, 12))  # type: ignore[arg-type]
    copied = list(range(10, 22))
    hybrid.reset([*copied, 5, *copied[:9]])  # the tail matches 9 tokens back
    draft = hybrid.propose(2, SamplingConfig(), torch.Generator())
    passed, failed = LOOKUP_PRIOR  # a third: wary until a proposal is scored
    assert hybrid.lookup.matched == 9 and hybrid.lookup_score == pytest.approx(1 / 3)
    hybrid.commit(copied[9:11])  # the target went on as the match did: 2 passed, no failure
    after = [0.7 * passed + 2, 0.7 * failed]
    assert hybrid.lookup_counts == {8: after} and hybrid.lookup_pooled == after
    assert draft.ids
    hybrid.propose(2, SamplingConfig(), torch.Generator())
    hybrid.commit([copied[11], 99])  # the first passed, the second failed
    assert hybrid.lookup_counts[8] == pytest.approx([0.7 * after[0] + 1, 0.7 * after[1] + 1])
    hybrid.reset([1, 2, 3, 1, 2])  # a 2-token match, its length not scored yet
    hybrid.propose(2, SamplingConfig(), torch.Generator())
    assert hybrid.lookup.matched == 2 and hybrid.lookup_score == pytest.approx(1 / 3)  # prior
    hybrid.lookup_pooled = [1.0, 9.0]  # every proposal failing: an unscored length too
    assert hybrid.lookup_score == pytest.approx(0.1)
    hybrid.lookup_counts[1] = [9.0, 1.0]
    assert hybrid.lookup_score == pytest.approx(0.9)  # a shorter length's higher rate counts
    hybrid.lookup_counts[2] = [1.0, 9.0]
    assert hybrid.lookup_score == pytest.approx(0.9)


def test_the_hybrid_counts_copies_that_begin_inside_plain_runs() -> None:
    passage = list(range(10, 30))
    hybrid = HybridDrafter(ZeroModel(), PromptLookupDrafter(1, 12))  # type: ignore[arg-type]
    hybrid.reset([*passage, 1])
    assert hybrid.copy_rate == pytest.approx(COPY_PRIOR[0] / COPY_PRIOR[1])
    hybrid.propose(0, SamplingConfig(), torch.Generator())  # k = 0: nothing sent
    assert not hybrid.sent_lookup
    # a plain run of 9: 3 fresh tokens, then the passage's first 6 (a copy begins at the
    # 4th token's place: after passage[:4] the tail matches 4 tokens and proposes the rest)
    run = [2, 3, 4, *passage[:6]]
    hybrid.commit(run)
    assert hybrid.lookup.tokens[-9:] == run  # every token reached the lookup
    assert hybrid.copies == pytest.approx([0.7 * COPY_PRIOR[0] + 1, 0.7 * COPY_PRIOR[1] + 8])
    hybrid.propose(0, SamplingConfig(), torch.Generator())
    before = hybrid.copy_rate
    hybrid.commit([5, 6, 7, 8])  # fresh text: no copy begun, the rate falls
    assert hybrid.copy_rate < before
    hybrid.propose(4, SamplingConfig(), torch.Generator())  # the model drafted: not a plain run
    copies = list(hybrid.copies)
    hybrid.commit([0, 0, 0])
    assert hybrid.copies == copies
    hybrid.commit([2, 3, 4, *passage[:6]])  # a block drafted ahead (no propose): not a run
    assert hybrid.copies == copies


def test_bigram_chains_the_most_frequent_successor() -> None:
    drafter = BigramDrafter()
    drafter.reset([1, 2, 1, 2, 1, 3, 2])
    assert propose(drafter, 3) == [1, 2, 1]


def test_bad_ngram_options() -> None:
    with pytest.raises(ValueError):
        NGramDrafter(n=1)
    with pytest.raises(ValueError):
        NGramDrafter(kind="other")


def test_heuristic_schedule_grows_by_two_and_shrinks_by_one() -> None:
    policy = HeuristicLength(start=4, max_k=8)
    policy.update(observed(4, 4, 0.0, 0.1))
    assert policy.next_k() == 6
    policy.update(observed(6, 6, 0.0, 0.1))
    assert policy.next_k() == 8  # capped
    policy.update(observed(8, 3, 0.0, 0.1))
    assert policy.next_k() == 7


def test_cost_model_prefers_long_drafts_when_the_round_trip_dominates() -> None:
    near, far = CostModelLength(max_k=16), CostModelLength(max_k=16)
    chosen: dict[int, list[int]] = {0: [], 1: []}
    for _ in range(50):  # the first 3 drafts accepted, the 4th never; 10 ms per drafted token
        for i, (policy, rtt) in enumerate(((near, 0.02), (far, 0.5))):
            k = policy.next_k()
            chosen[i].append(k)
            accepted = min(k, 3)
            policy.update(observed(k, accepted, 0.01 * k, rtt))
    # k = 4 and 3 are near-ties far away (the 4th draft fails): compare the recent choices
    assert sum(chosen[1][-20:]) > sum(chosen[0][-20:])
    assert 0 not in chosen[0][5:] and 0 not in chosen[1][5:]  # drafting pays for both
    # expected tokens per block follow 1 + sum of survival products
    model = CostModelLength(max_k=4, prior_weight=1e-9)
    model.reached, model.passed = [1.0] * 4, [0.5] * 4  # c_i = 0.5 at every position
    model.draft_s_per_token, model._rtt = 0.0, [1.0, 0.0, 0.0, 1.0, 0.0]  # rtt(k) = 1 s
    assert model.expected_rate(4) == pytest.approx(1 + 0.5 + 0.25 + 0.125 + 0.0625)


def test_cost_model_shortens_drafts_when_drafting_is_expensive() -> None:
    cheap, costly = CostModelLength(max_k=16), CostModelLength(max_k=16)
    for _ in range(50):
        for policy, per_token in ((cheap, 0.001), (costly, 0.2)):
            k = policy.next_k()
            policy.update(observed(k, min(k, 2), per_token * k, 0.2))
    assert costly.next_k() < cheap.next_k()


def test_cost_model_drafts_nothing_where_no_k_pays_and_probes_again_later() -> None:
    """Drafting at 0.4 of a plain step per token and verify blocks a little dearer than a
    step: with half the drafts accepted no k beats plain decode steps, so it drafts nothing,
    probing with k = 1 now and then (drafting would pay at high acceptance), the probes
    together costing at most PROBE_SHARE of the plain steps' time (a probe here costs 0.56 of
    a step: one every 19 steps); once every draft is accepted, a probe finds it and it drafts
    again."""
    step = {0: 0.39, 1: 0.45, 2: 0.50, 3: 0.55, 4: 0.60}
    policy = CostModelLength(max_k=4, probe_every=4, max_probe_gap=16)
    chosen = []
    for _ in range(60):
        k = policy.next_k()
        chosen.append(k)
        policy.update(observed(k, k // 2, 0.16 * k, step[k]))  # half the drafts accepted
    plain = chosen[10:]
    assert plain.count(0) >= 0.8 * len(plain)  # mostly plain steps
    probes = [i for i, k in enumerate(chosen) if k > 0 and i >= 10]
    assert len(probes) >= 2 and {chosen[i] for i in probes} == {1}  # it kept looking, cheaply
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert min(gaps) >= 17 and max(gaps) <= 21  # the budget, not the doubling, spaces them
    assert policy.probe_s <= PROBE_SHARE * policy.plain_s
    rate = {k: policy.expected_rate(k) for k in range(1, 5)}
    assert max(rate.values()) < policy.plain_rate() and policy.could_pay()
    for _ in range(60):  # now every draft is accepted: it drafts again
        k = policy.next_k()
        chosen.append(k)
        policy.update(observed(k, k, 0.16 * k, step[k]))
    assert chosen[-10:].count(0) == 0


def test_no_probes_where_drafting_could_not_pay_even_at_high_acceptance() -> None:
    """float32 on 2 cores: a 2-token verify costs 1.9x a plain step and a drafted token 0.4 of
    one. At 90% acceptance no k beats plain steps, so after its first blocks it never drafts
    again: a probe could only cost time."""
    verify_ms = [(0, 390.0), (1, 750.0), (2, 1120.0), (3, 1150.0), (4, 1150.0)]
    policy = CostModelLength(max_k=4, verify_ms=verify_ms)
    chosen = []
    for _ in range(80):
        k = policy.next_k()
        chosen.append(k)
        policy.update(observed(k, k, 0.16 * k, dict(verify_ms)[k] / 1e3))  # every draft accepted
    assert not policy.could_pay() and chosen[3:].count(0) == len(chosen) - 3
    cheap = CostModelLength(max_k=4, verify_ms=[(k, 200.0) for k in range(5)])
    cheap.update(observed(2, 2, 0.05, 0.2))
    cheap.update(observed(2, 2, 0.05, 0.2))
    assert cheap.could_pay()


def test_cost_model_starts_from_the_verifiers_measured_costs() -> None:
    """Seeded with verify costs where a block costs 1.9x a plain step (float32 on 2 cores), it
    needs no plain step of its own to know that, and drafts nothing after its first blocks
    show drafting at 0.4 of a step; unseeded, it has to try k = 0 first."""
    verify_ms = [(0, 390.0), (1, 750.0), (2, 1120.0), (3, 1150.0), (4, 1150.0)]
    seeded = CostModelLength(max_k=4, verify_ms=verify_ms)
    assert seeded.measured(0) and seeded.rtt(2) == pytest.approx(1.12)
    chosen = []
    for _ in range(4):
        k = seeded.next_k()
        chosen.append(k)
        seconds = dict(verify_ms)[k] / 1e3 + 0.002
        seeded.update(observed(k, k // 2, 0.16 * k, seconds))
    assert chosen[:2] == [2, 2] and chosen[2:] == [0, 0]
    assert make_draft_length("auto", 4, verify_ms).rtt(0) == pytest.approx(0.39)


def test_free_drafts_are_sized_by_the_verify_cost_of_each_length() -> None:
    """A prompt-lookup draft costs nothing to make: where a 9-token verify costs 1.4x a plain
    step (bf16 on this CPU) a trusted match drafts long; where a 2-token verify costs 1.9x
    (float32) it drafts nothing unless the match is almost always right."""
    flat = [(0, 193.0), (1, 191.0), (2, 217.0), (3, 220.0), (4, 260.0), (6, 265.0), (8, 271.0)]
    steep = [(0, 390.0), (1, 750.0), (2, 1120.0), (3, 1150.0), (4, 1150.0), (6, 1200.0),
             (8, 1250.0)]
    cheap = CostModelLength(max_k=16, verify_ms=flat)
    costly = CostModelLength(max_k=16, verify_ms=steep)
    assert cheap.free_k(0.9) == 9  # one past the longest length it knows the cost of
    assert cheap.free_k(0.3) <= 2
    assert costly.free_k(0.5) == 0 and costly.free_k(0.99) >= 4
    assert CostModelLength(max_k=16).free_k(0.9) == 0  # nothing measured yet
    assert FixedLength(4).free_k(0.9) is None and HeuristicLength().free_k(0.9) is None


def test_the_hybrid_drafts_free_lookup_matches_at_the_cost_models_length() -> None:
    class Model(Drafter):  # a model drafter that must not run while the lookup is trusted
        name = "m"

        def reset(self, prompt_ids: list[int], encoder_ids: list[int] | None = None) -> None:
            pass

        def propose(self, k: int, config: SamplingConfig, generator: torch.Generator) -> Any:
            raise AssertionError("the model ran")

        def commit(self, tokens: list[int]) -> None:
            pass

    hybrid = HybridDrafter(Model(), PromptLookupDrafter(1, 3))  # type: ignore[arg-type]
    hybrid.reset([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 5, 6])  # "5 6" seen before: 7 8 9 ... next
    hybrid.lookup_pooled = [9.0, 1.0]  # every match trusted: 0.9

    class Advisor:
        def free_k(self, trust: float) -> int:
            return 6 if trust > 0.5 else 0

        def prefers_free(self, trust: float) -> bool:
            return True

    hybrid.advisor = Advisor()  # type: ignore[assignment]
    draft = hybrid.propose(0, SamplingConfig(), torch.Generator())  # k = 0: still free drafts
    assert draft.ids == [7, 8, 9, 10, 11, 12]


def test_make_draft_length() -> None:
    assert isinstance(make_draft_length("3", 8), FixedLength)
    assert isinstance(make_draft_length("auto", 8), CostModelLength)
    assert isinstance(make_draft_length("heuristic", 8), HeuristicLength)
    with pytest.raises(ValueError, match="at most|in \\[0, 8\\]"):
        make_draft_length("9", 8)
    with pytest.raises(ValueError, match="'auto'"):
        make_draft_length("often", 8)


def test_cost_model_judges_measured_draft_lengths_by_their_own_times() -> None:
    """A verify's cost is not a line in k everywhere (CPU matmul kernels switch at some
    widths): a k that was measured is judged by its own round trips, so a cheap k = 2 beats a
    k = 4 whose measured cost is far above what a line through the others would say."""
    rtt = {0: 0.24, 1: 0.25, 2: 0.26, 3: 0.27, 4: 0.50, 5: 0.51, 6: 0.53, 7: 0.67, 8: 0.69}
    policy = CostModelLength(max_k=8)
    for _ in range(200):  # every position accepted with probability 0.7 (expected counts)
        k = policy.next_k()
        policy.update(observed(k, int(0.7 * k), 0.0, rtt[k]))
        for probe in (2, 4):  # and both candidates measured now and then
            policy.update(observed(probe, int(0.7 * probe), 0.0, rtt[probe]))
    assert policy.rtt(4) == pytest.approx(0.50) and policy.rtt(2) == pytest.approx(0.26)
    assert policy.next_k() <= 3


def test_cost_model_does_not_count_the_drafters_prompt_prefill() -> None:
    """The first block's drafting time includes the drafter's prefill of the prompt; as a
    per-token cost it made k = 1 look best for many blocks while every draft was accepted."""
    rtt = {0: 0.23, 1: 0.246, 2: 0.264, 3: 0.476, 4: 0.49}
    policy = CostModelLength(max_k=4)
    chosen = []
    k = policy.next_k()
    # the prompt's prefill inside the first block's drafting
    policy.update(observed(k, k, 0.55, rtt[k]))
    for _ in range(20):
        k = policy.next_k()
        chosen.append(k)
        policy.update(observed(k, k, 0.09 * k, rtt[k]))  # 90 ms per drafted token, all accepted
    assert 1 not in chosen and chosen[-1] == 2 and chosen.count(0) == 1  # one plain step
    assert policy.draft_s_per_token == pytest.approx(0.09)
