"""The KV pool's growing regions (shared/engines/transformers/kv_pool.py, issue #24): a buddy
allocator hands out regions of 2^i smallest sizes, a session that outgrows its region moves to a
larger one with its cache intact and its slot id kept, the target's logits stay the full sequence's
own across every move, each forward sends its indices to the device in one copy, and a pool that is
full evicts an idle session (by the store's policy) instead of failing a live one."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from shared.engines.target import ForwardItem
from shared.engines.transformers import kv_pool
from shared.engines.transformers.kv_pool import KVPool
from shared.engines.transformers.kv_regions import Regions
from shared.engines.transformers.target import CausalEngine
from shared.models.catalog import load_causal_lm, load_tokenizer
from shared.protocol.schema import PROTOCOL_VERSION
from shared.protocol.transfer import Upload
from tests.support.live_server import LiveServer, fp32_settings
from tests.support.prometheus import scrape


def test_regions_split_merge_and_hand_out_whole_slabs() -> None:
    regions = Regions(total=4 * 64, smallest=16, slab=64)  # 4 slabs, each one top block
    assert regions.top == regions.power == 2 and regions.total == 256
    initial = [set(bases) for bases in regions.free]
    assert initial == [set(), set(), {0, 64, 128, 192}]
    a, b = regions.allocate(0), regions.allocate(0)
    assert (a, b) == (0, 16) and regions.free[1] == {32}  # a 64 split into 16 + 16 + 32
    c = regions.allocate(2)
    assert c == 64 and regions.free_tokens == 256 - 32 - 64
    assert not regions.grow(16, 0, 1)  # an upper half cannot take the room after it
    assert regions.grow(a, 0, 0) and not regions.grow(a, 0, 1)  # 16 is taken
    for base, order in ((a, 0), (b, 0), (c, 2)):
        regions.release(base, order)
    assert [set(bases) for bases in regions.free] == initial  # every buddy merged back
    everything = [regions.allocate(0) for _ in range(256 // 16)]
    assert sorted(everything) == list(range(0, 256, 16))  # type: ignore[type-var]
    assert regions.allocate(0) is None and regions.free_tokens == 0
    for base in everything:
        regions.release(base, 0)  # type: ignore[arg-type]
    regions.take(16, 0)  # a given block, split out of the free 64 around it
    assert regions.free[0] == {0} and regions.free[1] == {32} and 0 not in regions.free[2]


def test_a_slab_that_is_no_power_of_two_is_handed_out_whole() -> None:
    """A 48-token context in blocks of 16: a slab is a 32 and a 16, or all 48 at once."""
    regions = Regions(total=100, smallest=16, slab=48)  # 2 slabs; the last 4 tokens unused
    assert (regions.power, regions.top, regions.total) == (1, 2, 96)
    assert regions.layout == [(0, 1), (32, 0)] and regions.order_for(33) == 2
    assert regions.order_for(49) is None and regions.size(2) == 48
    a = regions.allocate(0)  # the smallest free block first: slab 0's 16 at 32
    assert a == 32
    whole = regions.allocate(2)
    assert whole == 48 and regions.allocate(2) is None  # slab 1 whole; slab 0 is in use
    b = regions.allocate(0)
    assert b == 0 and not regions.grow(b, 0, 2)  # slab 0's 16 at 32 is taken
    regions.release(a, 0)
    assert regions.grow(b, 0, 2) and regions.free_tokens == 0  # all of slab 0 now
    regions.release(b, 2)
    regions.release(whole, 2)
    assert regions.free == [{32, 80}, {0, 48}]


def pool(total: int, slot_tokens: int, monkeypatch: pytest.MonkeyPatch) -> KVPool:
    monkeypatch.setattr(kv_pool, "SMALLEST_REGION", 8)
    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                             num_hidden_layers=2)
    return KVPool(config, 0, slot_tokens, torch.float32, torch.device("cpu"), total_tokens=total)


def test_a_slot_grows_with_its_cache_and_keeps_its_id(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = pool(64, 32, monkeypatch)  # two 32-token slabs of regions 8, 16, 32: 8 sessions at 8
    assert kv.num_slots == 8 and kv.free_slots == 8 and kv.slot_tokens == 32
    a, b = kv.allocate(), kv.allocate()
    assert a is not None and b is not None and kv.capacity(a) == 8
    for layer in range(2):
        kv.region(kv.keys[layer], a)[:] = torch.randn(2, 8, 8)
    before = [kv.region(c, a).clone() for c in (*kv.keys, *kv.values)]
    assert kv.reserve(a, 8) and kv.moves == 0  # fits: nothing moves
    assert kv.reserve(a, 20) and kv.capacity(a) == 32 and kv.moves == 1
    for cache, old in zip((*kv.keys, *kv.values), before, strict=True):
        torch.testing.assert_close(kv.region(cache, a)[:, :8], old)
    assert not kv.reserve(a, 33)  # past the longest context
    assert kv.free_slots == 64 // 8 - 1 - 4  # b holds 8, a holds 32
    c = kv.allocate()
    assert c is not None and not kv.reserve(c, 32) and kv.capacity(c) == 8  # no 32 free
    kv.release(a)
    assert kv.reserve(c, 32)
    with pytest.raises(ValueError, match="already free"):
        kv.release(a)


def ids(n: int, seed: int) -> list[int]:
    return [(seed * 31 + i * 7) % 64 for i in range(n)]


@pytest.mark.parametrize("attention", ["per-session", "padded"])
def test_moved_sessions_score_as_the_full_sequence(
        attention: str, tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Two sessions grow from 32-token regions to 128 and 256 in one pool, in batches with each
    other; every row equals the model's own forward over the whole sequence."""
    monkeypatch.setattr(kv_pool, "SMALLEST_REGION", 32)
    path = tiny_models["llama-target"]
    reference = load_causal_lm(str(path), torch.float32, torch.device("cpu"))
    engine = CausalEngine(load_causal_lm(str(path), torch.float32, torch.device("cpu")),
                          load_tokenizer(str(path)), str(path), max_context=256,
                          kv_budget_tokens=512)
    engine.attention = attention
    slots = [engine.allocate(), engine.allocate()]
    assert None not in slots and engine.pool.capacity(slots[0]) == 32  # type: ignore[arg-type]
    seqs = [ids(20, 1), ids(27, 2)]
    engine.forward([ForwardItem(s, 0, seq, False) for s, seq in zip(slots, seqs, strict=True)])  # type: ignore[arg-type]
    for step in range(9):  # blocks of 5 and 17 tokens: 20 -> 101 and 27 -> 132 tokens
        blocks = [ids(5, 10 + step), ids(17, 20 + step)] if step < 6 else [ids(17, step), [3]]
        items = [ForwardItem(s, len(seq), block, True)  # type: ignore[arg-type]
                 for s, seq, block in zip(slots, seqs, blocks, strict=True)]
        rows = engine.forward(items)
        for seq, block, got in zip(seqs, blocks, rows, strict=True):
            seq.extend(block)
            want = reference(input_ids=torch.tensor([seq])).logits[0, -len(block):]
            assert got is not None
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert engine.pool.moves >= 1 and {engine.pool.capacity(s) for s in slots} == {128, 256}  # type: ignore[arg-type]
    assert engine.counters()["kv_region_moves"] == engine.pool.moves  # /metrics reads it


def test_a_batched_forward_sends_its_indices_in_one_copy(
        tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #24: a padded forward of three verify blocks did 10 host syncs (9 index uploads and
    one download). Now: one upload, no read back to the host, whatever the batch holds."""
    path = tiny_models["llama-target"]
    engine = CausalEngine(load_causal_lm(str(path), torch.float32, torch.device("cpu")),
                          load_tokenizer(str(path)), str(path), max_context=256,
                          kv_budget_tokens=1024)
    engine.attention = "padded"
    slots = [engine.allocate() for _ in range(3)]
    for slot, n in zip(slots, (30, 7, 50), strict=True):
        engine.forward([ForwardItem(slot, 0, ids(n, n), False)])  # type: ignore[arg-type]
    reads: list[str] = []
    for name in ("item", "tolist", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *a: object, _name: str = name,
                    _original: object = original, **k: object) -> object:
            reads.append(_name)
            return _original(self, *a, **k)  # type: ignore[operator]
        monkeypatch.setattr(torch.Tensor, name, counted)
    sent = Upload.count
    rows = engine.forward([ForwardItem(slots[0], 30, ids(5, 1), True),  # type: ignore[arg-type]
                           ForwardItem(slots[1], 7, ids(3, 2), True),  # type: ignore[arg-type]
                           ForwardItem(slots[2], 50, ids(1, 3), True)])  # type: ignore[arg-type]
    assert Upload.count - sent == 1 and reads == []
    assert [r.shape[0] for r in rows if r is not None] == [5, 3, 1]
    sent = Upload.count
    engine.keep_path(slots[0], 35, [1, 3])  # a tree's accepted path: once, not per layer
    engine.pool.reorder(slots, [0, 0, 1], 20)  # beams following their parents
    assert Upload.count - sent == 2 and reads == []


def test_a_full_pool_evicts_an_idle_session_for_a_growing_one(
        tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool of 128 tokens, regions of 32 to 128: four sessions open; when the first grows
    past 64 tokens the idle ones are evicted (404 on their next call), and its answers stay the
    target's greedy ones."""
    from tests.support.tiny_models import hf_greedy

    monkeypatch.setattr(kv_pool, "SMALLEST_REGION", 32)
    path = tiny_models["llama-target"]
    settings = fp32_settings(path, max_context=128, kv_budget_tokens=128, max_draft_tokens=8,
                             batching=False, session_protect_s=0.0)  # idle at once
    tokenizer = load_tokenizer(str(path))
    prompt = tokenizer.encode("the cat sat on")
    with LiveServer(settings) as server, httpx.Client(base_url=server.url) as http:
        def create() -> str:
            reply = http.post("/v1/sessions", json={"protocol_version": PROTOCOL_VERSION,
                                                    "prompt_ids": prompt})
            assert reply.status_code == 200, reply.text
            return str(reply.json()["session_id"])

        first, *others = [create() for _ in range(4)]
        position, last, tokens = len(prompt), prompt[-1], []
        while position < 100:  # plain steps: 32 -> 64 -> 128 tokens
            reply = http.post(f"/v1/sessions/{first}/verify", json={
                "position": position, "last_token": last, "final_uniform": 0.5})
            assert reply.status_code == 200, reply.text
            last, position = reply.json()["next_token"], reply.json()["position"]
            tokens.append(last)
        metrics = http.get("/v1/metrics").json()
        scraped = scrape(server.url)
        gone = [http.post(f"/v1/sessions/{s}/verify", json={
            "position": len(prompt), "last_token": prompt[-1], "final_uniform": 0.5}).status_code
            for s in others]
    assert tokens == hf_greedy(path, prompt, len(tokens))
    assert metrics["evicted_sessions"] >= 2 and gone.count(404) >= 2
    assert scraped["specdec_verifier_kv_region_moves_total"][()] == metrics["kv_region_moves"]
    assert scraped["specdec_verifier_sessions_evicted_total"][()] == metrics["evicted_sessions"]


def test_masked_attention_folds_the_head_group_instead_of_enable_gqa(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #24: a bool mask with ``enable_gqa`` rules out the flash kernel on CUDA and may
    fall back to the math kernel. The masked calls fold the group into the query rows (same
    result), prefills pass ``is_causal``; ``attention_kernels`` names the kernel of each."""
    from torch.nn import functional as F

    from shared.engines.transformers.kv_pool import attention_kernels, grouped_attention

    torch.manual_seed(0)
    q, k, v = torch.randn(3, 6, 5, 8), torch.randn(3, 2, 40, 8), torch.randn(3, 2, 40, 8)
    mask = torch.rand(3, 1, 5, 40) > 0.3
    mask[..., 0] = True
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    causal = F.scaled_dot_product_attention(q[:1, :, :5], k[:1, :, :5], v[:1, :, :5],
                                            is_causal=True, enable_gqa=True)
    calls: list[dict[str, object]] = []
    original = F.scaled_dot_product_attention

    def recorded(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(kwargs)
        return original(*args, **kwargs)  # type: ignore[arg-type]
    monkeypatch.setattr(F, "scaled_dot_product_attention", recorded)
    torch.testing.assert_close(grouped_attention(q, k, v, mask, None), want)
    torch.testing.assert_close(grouped_attention(q[:1, :, :5], k[:1, :, :5], v[:1, :, :5],
                                                 None, None), causal)
    assert not calls[0].get("enable_gqa") and calls[0]["attn_mask"] is not None
    assert calls[1]["is_causal"] is True and calls[1].get("attn_mask") is None
    monkeypatch.undo()
    config = SimpleNamespace(num_attention_heads=6, num_key_value_heads=2, hidden_size=48)
    kernels = attention_kernels(config, torch.float32, torch.device("cpu"))
    assert set(kernels) == {"padded_group", "block_alone", "decode_step", "prefill",
                            "block_alone_odd_end", "masked_enable_gqa"}
    assert set(kernels.values()) <= {"FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH",
                                     "CUDNN_ATTENTION", "OVERRIDEABLE", "unknown"}
    assert kernels["padded_group"] != "unknown"  # this torch answers


def test_a_context_that_is_no_power_of_two_is_held_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = pool(40, 40, monkeypatch)  # one 40-token slab: a 32 and an 8, or all 40
    assert kv.slot_tokens == 40 and kv.regions.total == 40 and kv.num_slots == 5
    slot = kv.allocate()
    assert slot is not None and kv.reserve(slot, 40) and not kv.reserve(slot, 41)


def test_on_cuda_the_pool_is_sized_from_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #24: 4096-token slots in a 65,536-token budget gave 16 slots for 64 clients. On
    CUDA the budget is what ``kv_memory_fraction`` of the device leaves after the model and a
    forward's activations: on an H200 (139 GiB) holding a 1.5B bf16 target, far more than 256
    sessions of 2k tokens. A device with no room is a clear error."""
    from transformers import Qwen2Config

    from scripts.bench.gpu import SHAPES
    from shared.engines.transformers.models import DEFAULT_KV_BUDGET, kv_budget, kv_bytes_per_token
    from shared.models.catalog import ModelSpecError

    config = Qwen2Config(**SHAPES["qwen1.5b"])
    gib = 2**30
    assert kv_bytes_per_token(config, torch.bfloat16) == 2 * 28 * 2 * 128 * 2  # 28 KiB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (136 * gib, 139 * gib))
    cuda = torch.device("cuda")
    tokens = kv_budget(config, torch.bfloat16, cuda, 0, 0.9, 2048)
    assert tokens >= 256 * 2048
    assert tokens * kv_bytes_per_token(config, torch.bfloat16) < 0.9 * 139 * gib - 3 * gib
    assert kv_budget(config, torch.bfloat16, cuda, 5000, 0.9, 2048) == 5000  # as asked
    assert kv_budget(config, torch.bfloat16, torch.device("cpu"), 0, 0.9, 2048) == \
        DEFAULT_KV_BUDGET
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (4 * gib, 80 * gib))
    with pytest.raises(ModelSpecError, match="kv_memory_fraction"):
        kv_budget(config, torch.bfloat16, cuda, 0, 0.9, 2048)
