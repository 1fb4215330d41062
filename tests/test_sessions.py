"""Session store: LRU eviction, idle TTL, clear 404s; the HF drafter's cache rollback."""

from __future__ import annotations

import pytest
import torch

from shared.engines.drafter import common_prefix
from shared.engines.transformers.drafter import HFDrafter
from shared.models.catalog import load_causal_lm
from shared.protocol.sampling import SamplingConfig
from verifier_service.errors import VerifierError
from verifier_service.scheduling.sessions import Session, SessionStore


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(store: SessionStore, owner: str | None = None) -> Session:
    store.reserve(owner)
    store.make_room(owner, keep=set())
    session = Session(slot=len(store), position=1, config=SamplingConfig(), owner=owner)
    store.add(session)
    return session


def test_lru_evicts_the_least_recently_used_of_the_same_owner() -> None:
    dropped: list[Session] = []
    store = SessionStore(max_sessions=2, ttl_s=100, clock=FakeClock(), on_drop=dropped.append)
    a, b = make(store, "k"), make(store, "k")
    store.get(a.id, "k")  # a is now more recent than b
    c = make(store, "k")
    assert store.get(a.id, "k") is a and store.get(c.id, "k") is c
    with pytest.raises(VerifierError) as err:
        store.get(b.id, "k")
    assert err.value.status == 404 and store.evicted == 1
    assert dropped == [b]  # its KV slot was handed back
    assert store.evict_one_for("k", keep={a.key}) and dropped[-1] is c  # a is busy: c goes
    assert not store.evict_one_for("k", keep={a.key})


def test_without_keys_a_create_evicts_only_a_session_idle_past_its_window() -> None:
    """Without API keys every session has the same owner but belongs to another client: a
    create never evicts a live one (503, nobody evicted), only the least recently used of
    those idle past their protection window."""
    clock, dropped = FakeClock(), []
    store = SessionStore(max_sessions=2, ttl_s=100, clock=clock, on_drop=dropped.append,
                         protect_s=2.0)
    a, b = make(store), make(store)
    with pytest.raises(VerifierError) as busy:
        make(store)
    store.unreserve(None)
    assert busy.value.status == 503 and busy.value.retry_after_s and store.evicted == 0
    clock.now += 3.0
    store.get(a.id)  # a is live again; b has been idle for 3 s, past its 2 s window
    c = make(store)
    assert store.get(a.id) is a and store.get(c.id) is c and dropped == [b]
    clock.now += 3.0
    assert store.evict_one_for(None, keep={a.key}) and dropped[-1] is c  # a is busy: c goes
    assert not store.evict_one_for(None, keep={a.key})


def test_another_key_evicts_only_sessions_idle_past_their_window() -> None:
    clock = FakeClock()
    store = SessionStore(max_sessions=2, ttl_s=100, clock=clock, protect_s=2.0)
    slow = make(store, "k1")
    for _ in range(3):  # a live client with a 1 s round trip: window 4 x 1 s
        clock.now += 1.0
        store.get(slow.id, "k1")
    flood = make(store, "k2")
    clock.now += 3.0  # slow's next call is due: 3 s idle, inside its 4 s window
    second = make(store, "k2")  # the table is full: k2 evicts its own session, not slow
    assert not store.exists(flood.id, "k2") and store.exists(slow.id, "k1")
    store.reserve("k2")
    with pytest.raises(VerifierError) as err:  # k2's session is busy, slow is protected
        store.make_room("k2", keep={second.key})
    assert err.value.status == 503 and err.value.retry_after_s == 1
    store.unreserve("k2")
    assert store.exists(slow.id, "k1")
    clock.now += 2.0  # 5 s idle: past its window, a dead client's session may go
    assert store.evict_one_for("k2", keep={second.key})
    assert not store.exists(slow.id, "k1")


def test_ids_are_scoped_by_owner() -> None:
    store = SessionStore(max_sessions=8, ttl_s=100, clock=FakeClock())
    mine = Session(slot=0, position=1, config=SamplingConfig(), id="sessAAAA1111", owner="k1")
    theirs = Session(slot=1, position=5, config=SamplingConfig(), id="sessAAAA1111", owner="k2")
    for session in (mine, theirs):
        store.reserve(session.owner)
        store.add(session)
    assert store.get("sessAAAA1111", "k1") is mine and store.get("sessAAAA1111", "k2") is theirs
    store.remove("sessAAAA1111", "k2")
    assert store.get("sessAAAA1111", "k1") is mine
    with pytest.raises(VerifierError):
        store.get("sessAAAA1111", "k2")


def test_quota_counts_creates_in_flight() -> None:
    store = SessionStore(max_sessions=8, ttl_s=100, clock=FakeClock(), max_per_owner=2)
    store.reserve("k1")
    store.reserve("k1")  # two creates admitted, none finished yet
    with pytest.raises(VerifierError) as err:
        store.reserve("k1")
    assert err.value.status == 429
    store.reserve("k2")  # other keys are not affected
    store.unreserve("k1")  # one create failed: its place is free again
    store.reserve("k1")


def test_idle_sessions_expire() -> None:
    clock = FakeClock()
    store = SessionStore(max_sessions=8, ttl_s=10, clock=clock)
    a, b = make(store), make(store)
    clock.now = 8
    store.get(a.id)  # touching a keeps it alive
    clock.now = 15
    assert store.expire_idle() == 1 and len(store) == 1
    with pytest.raises(VerifierError):
        store.get(b.id)
    clock.now = 30
    with pytest.raises(VerifierError) as err:
        store.get(a.id)
    assert "expired" in err.value.message


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0


def test_hf_drafter_rolls_back_to_the_committed_prefix(tiny_models) -> None:  # type: ignore[no-untyped-def]
    model = load_causal_lm(str(tiny_models["llama-drafter"]), torch.float32, torch.device("cpu"))
    drafter = HFDrafter(model, vocab_size=64)
    drafter.reset([2, 3, 4])
    draft = drafter.propose(4, SamplingConfig(), torch.Generator())
    # cache holds the prompt and the first 3 drafts (the 4th is never fed)
    assert drafter.cached == [2, 3, 4, *draft.ids[:3]]
    drafter.commit([draft.ids[0], 7 if draft.ids[1] != 7 else 8])  # 1 accepted + a recovered
    assert drafter.cached == [2, 3, 4, draft.ids[0]]
    assert drafter.cache.get_seq_length() == 4
    # All accepted + bonus: the next propose feeds the last draft and the bonus first.
    drafter.reset([2, 3, 4])
    draft = drafter.propose(2, SamplingConfig(), torch.Generator())
    drafter.commit([*draft.ids, 9])
    assert drafter.cached == [2, 3, 4, draft.ids[0]]
    follow = drafter.propose(1, SamplingConfig(), torch.Generator())
    fresh = HFDrafter(model, vocab_size=64)
    fresh.reset([2, 3, 4, *draft.ids, 9])
    assert follow.ids == fresh.propose(1, SamplingConfig(), torch.Generator()).ids


def test_a_new_sequence_keeps_the_drafters_cached_prefix(tiny_models) -> None:  # type: ignore[no-untyped-def]
    """The next turn of a chat re-sends the conversation: the drafter feeds only what is new
    (its cache keeps the common prefix with the new prompt, minus the last token), and drafts
    what a fresh drafter drafts. A prompt that shares nothing starts from an empty cache."""
    model = load_causal_lm(str(tiny_models["llama-drafter"]), torch.float32, torch.device("cpu"))
    drafter = HFDrafter(model, vocab_size=64)
    turn = [2, 3, 4, 5, 6]
    drafter.reset(turn)
    first = drafter.propose(3, SamplingConfig(), torch.Generator())
    drafter.commit([*first.ids[:2], 9])
    fed: list[list[int]] = []
    forward = drafter._forward

    def counted(ids: list[int]) -> torch.Tensor:
        fed.append(list(ids))
        return forward(ids)
    drafter._forward = counted  # type: ignore[method-assign]
    conversation = [*drafter.committed, 11, 12, 13]  # the answer, then the next user message
    drafter.reset(conversation)
    assert drafter.cached == conversation[:len(turn) + 2]  # the prompt and the kept drafts
    follow = drafter.propose(3, SamplingConfig(), torch.Generator())
    assert fed[0] == conversation[len(turn) + 2:]  # only the new tokens
    fresh = HFDrafter(model, vocab_size=64)
    fresh.reset(conversation)
    assert follow.ids == fresh.propose(3, SamplingConfig(), torch.Generator()).ids
    drafter.reset([7, 8])
    assert drafter.cached == [] and drafter.cache is not None
    assert drafter.cache.get_seq_length() == 0
    drafter.reset(conversation)  # the same prompt again after another: fed from scratch
    assert drafter.propose(3, SamplingConfig(), torch.Generator()).ids == follow.ids
