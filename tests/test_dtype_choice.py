"""``--dtype fastest`` (and a drafter's ``auto``) on a CPU measures float32 against bfloat16 on
the model itself and keeps the faster (issue #27); the choice is cached per model and machine,
and the model it returns is the model a direct load in that dtype gives (parameters and
buffers, bit for bit). A target's ``auto`` on a CPU is float32, where greedy speculation equals
the target alone's; in bfloat16 it does not (issue #41). The verifier reports its measured
verify costs in ``/v1/info``."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
import torch

from drafter_client import SpecDecClient
from shared.engines.transformers.dtype_choice import (
    block_ms,
    cache_path,
    load_fastest,
    load_lm_auto,
)
from shared.models.catalog import load_causal_lm
from shared.protocol.schema import InfoResponse
from tests.support.live_server import LiveServer
from tests.support.tiny_models import build_model, build_tokenizer
from verifier_service.settings import Settings

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def own_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDEC_DTYPE_CACHE", str(tmp_path / "home" / "dtype-choices.json"))


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> Path:
    """A tiny Llama saved in float32, or in bfloat16 (a narrow checkpoint)."""
    folder = tmp_path_factory.mktemp(f"ckpt-{request.param}")
    build_model("llama", 64, seed=3, init_range=0.3).to(getattr(torch, request.param)) \
        .save_pretrained(folder)
    build_tokenizer(64).save_pretrained(folder)
    return folder


def same_model(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    left, right = a.state_dict(), b.state_dict()
    buffers = dict(a.named_buffers()), dict(b.named_buffers())
    return (left.keys() == right.keys()
            and all(torch.equal(left[k], right[k]) and left[k].dtype == right[k].dtype
                    for k in left)
            and all(torch.equal(v, buffers[1][k]) and v.dtype == buffers[1][k].dtype
                    for k, v in buffers[0].items()))


class FakeTimer:
    """Block times by dtype: the chosen one is known in advance."""

    def __init__(self, fast: torch.dtype) -> None:
        self.fast, self.calls = fast, 0

    def __call__(self, model: torch.nn.Module) -> dict[int, float]:
        self.calls += 1
        slow = next(model.parameters()).dtype != self.fast
        return {1: 10.0 + 20 * slow, 3: 11.0 + 40 * slow, 5: 12.0 + 60 * slow}


@pytest.mark.parametrize("fast", [torch.float32, torch.bfloat16])
def test_the_faster_dtype_is_kept_and_equals_a_direct_load(checkpoint: Path,
                                                           fast: torch.dtype) -> None:
    spec = str(checkpoint)
    timer = FakeTimer(fast)
    model, choice = load_fastest(spec, lambda dt: load_causal_lm(spec, dt, CPU), timer)
    assert choice.dtype == fast and not choice.cached and timer.calls == 2
    assert set(choice.block_ms) == {"float32", "bfloat16"}
    assert same_model(model, load_causal_lm(spec, fast, CPU))
    assert model.dtype == fast
    # the next load on this machine reads the choice instead of measuring
    again, cached = load_fastest(spec, lambda dt: load_causal_lm(spec, dt, CPU), timer)
    assert cached.cached and cached.dtype == fast and timer.calls == 2
    assert same_model(again, model)
    assert cache_path().exists()


def test_block_times_are_measured_on_the_model(checkpoint: Path) -> None:
    model = load_causal_lm(str(checkpoint), torch.float32, CPU)
    timings = block_ms(model, repeats=1)
    assert list(timings) == [1, 3, 5] and all(ms > 0 for ms in timings.values())


def test_an_explicit_dtype_is_not_measured(checkpoint: Path) -> None:
    model, why = load_lm_auto(str(checkpoint), "float32", CPU)
    assert model.dtype == torch.float32 and "asked for" in why
    assert not cache_path().exists()
    model, why = load_lm_auto(str(checkpoint), "auto", CPU)  # a target's auto: exact
    assert model.dtype == torch.float32 and "auto on cpu" in why
    assert not cache_path().exists()
    model, why = load_lm_auto(str(checkpoint), "fastest", CPU)
    assert model.dtype in (torch.float32, torch.bfloat16) and "ms for 1 / 3 / 5" in why
    assert cache_path().exists()
    model, why = load_lm_auto(str(checkpoint), "auto", CPU, exact=False)  # a drafter's auto
    assert "measured before" in why


PROMPTS = [[int(t) for t in ids] for ids in np.random.default_rng(5).integers(2, 64, (8, 6))]


def greedy_differences(target: Path, drafter: Path, dtype: str) -> list[tuple[int, int]]:
    """(prompt, k) whose greedy speculation differs from the target alone's on a verifier of
    ``dtype``."""
    settings = Settings(model=str(target), dtype=dtype, device="cpu",  # type: ignore[arg-type]
                        max_draft_tokens=8)
    with LiveServer(settings) as live:
        alone = SpecDecClient(live.url, None, tokenizer=str(target))
        want = [alone.baseline(ids, max_new_tokens=48).token_ids for ids in PROMPTS]
        client = SpecDecClient(live.url, str(drafter), dtype="float32", device="cpu")
        return [(i, k) for k in (1, 3, 8) for i, ids in enumerate(PROMPTS)
                if client.generate(ids, num_draft_tokens=k, max_new_tokens=48).token_ids
                != want[i]]


@pytest.mark.slow  # measures the dtypes, then every k
def test_auto_keeps_greedy_speculation_equal_to_the_target_alone(
        tiny_models: dict[str, Path]) -> None:
    """auto (float32 here) against bfloat16, the negative control: its blocks round unlike its
    one-token steps and change greedy tokens."""
    target, drafter = tiny_models["llama-target"], tiny_models["llama-drafter"]
    assert greedy_differences(target, drafter, "auto") == []
    assert greedy_differences(target, drafter, "bfloat16") != []


def test_the_verifier_reports_its_measured_verify_costs(gpt2_server: LiveServer) -> None:
    info = httpx.get(gpt2_server.url + "/v1/info").json()
    ks = [k for k, _ in info["verify_ms"]]
    assert ks == [0, 1, 2, 3, 4, 6, 8]  # up to its max_draft_tokens (8)
    assert all(ms > 0 for _, ms in info["verify_ms"])
    assert InfoResponse.model_validate_json(orjson.dumps(info)).verify_ms is not None
