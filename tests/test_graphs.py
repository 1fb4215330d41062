"""The static-shape forwards behind ``--cuda-graphs`` (shared/engines/transformers/graphs.py), run
eagerly on CPU: the same bucket layout a CUDA graph replays - padded segments, a scratch slot, a
fixed attended prefix - must give the eager path's logits, keep the sessions' caches right across
calls, leave other slots alone, and hand batches that fit no bucket to the eager path."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from shared.engines.target import ForwardItem
from shared.engines.transformers.graphs import L_BUCKETS
from shared.engines.transformers.target import CausalEngine
from shared.models.catalog import load_causal_lm, load_tokenizer
from tests.support.live_server import LiveServer, fp32_settings


def load(path: Path) -> CausalEngine:
    return CausalEngine(load_causal_lm(str(path), torch.float32, torch.device("cpu")),
                        load_tokenizer(str(path)), str(path), max_context=256,
                        kv_budget_tokens=256 * 10)


def ids(n: int, seed: int) -> list[int]:
    return [(seed * 31 + i * 7) % 64 for i in range(n)]


@pytest.mark.parametrize("model", ["gpt2-target", "llama-target"])
def test_static_buckets_equal_the_eager_forward(tiny_models: dict[str, Path], model: str) -> None:
    eager, static = load(tiny_models[model]), load(tiny_models[model])
    static.enable_static_forwards(max_batch=8, capture=False)
    assert static.static is not None
    slots = []
    for runner in (eager, static):  # the same sessions in both: prefixes of 40, 3, 17, 240
        taken = [runner.allocate() for _ in range(4)]
        for slot, n in zip(taken, (40, 3, 17, 240), strict=True):
            runner.forward([ForwardItem(slot, 0, ids(n, 1 + n), False)])  # type: ignore[arg-type]
        slots.append(taken)
    assert static.static.replays == 2  # the 3- and 17-token prefills fit a bucket; 40 does not

    def steps(s: list[int | None], base: list[int]) -> list[ForwardItem]:
        return [
            ForwardItem(s[0], base[0], ids(5, 1), True),  # a verify block, k = 4
            ForwardItem(s[1], base[1], ids(1, 2), True),  # a decode step
            ForwardItem(s[2], base[2], ids(6, 3), True, tree_parents=[-1, 0, 0, 1, -1]),
            ForwardItem(s[3], base[3], ids(3, 4), True, keep_from=2),  # near the slot's end
        ]  # type: ignore[arg-type]

    base = [40, 3, 17, 240]
    for _ in range(3):  # the caches written by one step are read by the next
        want = eager.forward(steps(slots[0], base))
        got = static.forward(steps(slots[1], base))
        for a, b in zip(want, got, strict=True):
            assert a is not None and b is not None and a.shape == b.shape
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)  # other SDPA shapes
            assert torch.equal(b.argmax(-1), a.argmax(-1))
        base = [x + n for x, n in zip(base, (5, 1, 1, 3), strict=True)]  # keep one tree token
    assert static.static.replays == 5
    # every reachable bucket was built before the first call; E is the slot's 256 here
    assert set(static.static.buckets) == {(b, n, 256) for b in (1, 2, 4, 8) for n in L_BUCKETS}
    # 4 tokens at 252 would be padded to 5, past the 256-token slot: the eager path serves it.
    fallbacks = static.static.fallbacks
    static.forward([ForwardItem(slots[1][3], 252, ids(4, 5), True)])  # type: ignore[arg-type]
    assert static.static.fallbacks == fallbacks + 1


def test_greedy_generation_through_a_verifier_with_static_forwards(
        tiny_models: dict[str, Path]) -> None:
    """End to end: the same greedy tokens with and without ``--cuda-graphs`` (eager on CPU)."""
    from drafter_client import SpecDecClient

    outputs = []
    for graphs in (False, True):
        settings = fp32_settings(tiny_models["llama-target"], max_draft_tokens=8,
                                 cuda_graphs=graphs, max_context=256)
        with LiveServer(settings) as server:
            client = SpecDecClient(server.url, str(tiny_models["llama-drafter"]),
                                   dtype="float32", device="cpu")
            outputs.append([client.generate(p, num_draft_tokens=k, max_new_tokens=24).token_ids
                            for p in ("the cat sat on", "def x ( y ) :") for k in (1, 4)])
            metrics = httpx.get(server.url + "/v1/metrics").json()
            assert (metrics["static_forwards"] > 0) == graphs  # the buckets really served
    assert outputs[0] == outputs[1]


class FakeCuda:
    """Stands in for torch.cuda's capture API on CPU: records which device each call names,
    the error mode, and how many captures run at once (the buckets' forwards run eagerly)."""

    def __init__(self) -> None:
        self.devices: list[object] = []
        self.modes: list[str] = []
        self.inside = self.most_inside = 0
        self.lock = threading.Lock()

    def patch(self, monkeypatch: pytest.MonkeyPatch) -> None:
        fake = self

        class Stream:
            def __init__(self, device: object = None) -> None:
                fake.devices.append(("Stream", device))

            def wait_stream(self, _: object) -> None:
                pass

        class Graph:
            def replay(self) -> None:
                pass

        @contextlib.contextmanager
        def graph(_: object, pool: object = None, capture_error_mode: str = "global"
                  ) -> Iterator[None]:
            fake.modes.append(capture_error_mode)
            with fake.lock:
                fake.inside += 1
                fake.most_inside = max(fake.most_inside, fake.inside)
            time.sleep(0.01)  # kept: the window in which another thread would try its capture
            yield
            with fake.lock:
                fake.inside -= 1

        def current_stream(device: object = None) -> Stream:
            fake.devices.append(("current_stream", device))
            return Stream.__new__(Stream)

        @contextlib.contextmanager
        def device(dev: object) -> Iterator[None]:
            fake.devices.append(("device", dev))
            yield

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", graph)
        monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
        monkeypatch.setattr(torch.cuda, "device", device)
        monkeypatch.setattr(torch.cuda, "stream", lambda _: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")


def test_captures_name_their_device_and_run_one_at_a_time(
        tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #24: the side stream and graph pool landed on the current device (device 0 for a
    model on cuda:1), and the gateway's worker threads captured at once while others ran CUDA
    work ("operation not permitted when stream is capturing")."""
    fake = FakeCuda()
    fake.patch(monkeypatch)
    runners = [load(tiny_models["gpt2-target"]) for _ in range(3)]
    errors: list[BaseException] = []

    def build(runner: CausalEngine) -> None:
        try:
            runner.enable_static_forwards(max_batch=2, capture=True)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=build, args=(r,)) for r in runners]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    captured = sum(len(r.static.buckets) for r in runners if r.static is not None)
    assert len(fake.modes) == captured > 0 and set(fake.modes) == {"thread_local"}
    assert fake.most_inside == 1  # never two captures at once
    named = [dev for call, dev in fake.devices if call in ("Stream", "current_stream", "device")]
    assert named and all(dev == torch.device("cpu") for dev in named)  # the bucket's device


def test_every_reachable_bucket_is_built_before_serving(tiny_models: dict[str, Path],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #24: only E = 256 was captured at start, so the first batch on a longer context
    captured (and stalled everyone) while serving, and every bucket kept its own [B * L, vocab]
    output. Now: B x L x E for E in 256, 512, ... up to the context, built in ``warm``, writing
    one shared output; a batch at position 300 runs in a bucket built before it came."""
    from shared.engines.transformers import kv_pool

    monkeypatch.setattr(kv_pool, "SMALLEST_REGION", 64)
    path = tiny_models["llama-target"]
    model = load_causal_lm(str(path), torch.float32, torch.device("cpu"))
    model.config.max_position_embeddings = 1024  # rotary positions: any length works
    engine = CausalEngine(model, load_tokenizer(str(path)), str(path), max_context=1024,
                          kv_budget_tokens=4096)
    engine.enable_static_forwards(max_batch=4, capture=False, max_length=5)
    static = engine.static
    assert static is not None and static.ends == (256, 512, 1024)
    assert set(static.buckets) == {(b, n, e) for b in (1, 2, 4) for n in (1, 2, 3, 5)
                                   for e in (256, 512, 1024)}
    outputs = {bucket.output.data_ptr() for bucket in static.buckets.values()}
    assert outputs == {static.output.data_ptr()} and static.output.shape[0] == 4 * 5
    slot = engine.allocate()
    built = len(static.buckets)
    engine.forward([ForwardItem(slot, 0, ids(300, 1), False)])  # type: ignore[arg-type]
    replays = static.replays
    engine.forward([ForwardItem(slot, 300, ids(5, 2), True)])  # type: ignore[arg-type]
    assert static.replays == replays + 1 and len(static.buckets) == built  # (1, 5, 512)
