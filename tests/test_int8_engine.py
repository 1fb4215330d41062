"""The int8 engine computes every row as a one-token step computes it.

Its linear layers quantize each row alone (``Int8Linear``), attention runs each row over its
own prefix, and everything else is row-wise: a verify block's logits rows are bit-equal to
one-token steps', at any block length, after and beside other sessions, so greedy speculation
equals the target alone's. The negative control is ``SharedRangeLinear``: the same int8
weights with fbgemm's own activation range for the whole batch (what PyTorch's
``quantize_dynamic`` does), which must fail the same checks.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from drafter_client import SpecDecClient
from shared.engines.int8.kernels import (
    Int8Linear,
    SharedRangeLinear,
    activation_bits,
    has_vnni,
    quantized_engine,
)
from shared.engines.int8.model import Int8Decoder
from shared.engines.int8.target import Int8Engine
from shared.engines.transformers.models import eos_ids_of
from shared.models.catalog import load_causal_lm, load_tokenizer
from tests.support.greedy import speculative_vs_alone
from tests.support.live_server import LiveServer
from tests.support.row_layouts import block_layouts, rows_of
from tests.support.tiny_models import save_perturbed, save_tiny_qwen2
from verifier_service.settings import Settings, load_engine

VOCAB = 256


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("int8")
    target = save_tiny_qwen2(root / "target", VOCAB)
    return {"target": target, "drafter": save_perturbed(target, root / "drafter", 0.02, seed=3)}


@pytest.mark.parametrize("linear, invariant", [
    (Int8Linear, True), (functools.partial(Int8Linear, outliers=8), True),
    (functools.partial(Int8Linear, outliers=8, outlier_path="rows"), True),
    (SharedRangeLinear, False)])
def test_a_rows_product_does_not_depend_on_the_rows_beside_it(linear: Any,
                                                              invariant: bool) -> None:
    quantized_engine()
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 160, generator=generator) * 0.05
    product = linear(weight, torch.randn(96, generator=generator))
    x = torch.randn(17, 160, generator=generator) * torch.rand(17, 1, generator=generator) * 4
    alone = [product(x[r:r + 1]) for r in range(17)]
    same = [torch.equal(product(x[:n])[r:r + 1], alone[r]) for n in (2, 5, 8, 17)
            for r in range(n)]
    # shared: only rows that hold the batch's own extremes quantize as they do alone
    assert all(same) if invariant else sum(same) < len(same) // 2, same
    reference = x @ weight.T + product.bias  # int8 stays close to float32
    assert (product(x) - reference).abs().max() < 0.05 * reference.abs().max()


def test_a_rows_largest_value_is_not_clipped() -> None:
    """A row's largest magnitude (an outlier channel's) lands on the activation grid's top,
    either sign, so it passes unrounded; +1 itself (the old scaling) is a step past the top
    of fbgemm's grid for [-1, 1] and comes back a step short (the negative control)."""
    quantized_engine()
    weight = torch.zeros(8, 64)
    weight[:, 0] = 1.0  # output j = the row's first value
    x = torch.zeros(4, 64)
    x[:, 0] = torch.tensor([3.0, -3.0, 250.0, -0.01])
    x[:, 1:] = 0.001
    product = Int8Linear(weight, None, outliers=0)  # the grid alone, no value taken out
    assert torch.allclose(product(x)[:, 0], x[:, 0], rtol=1e-6, atol=0)
    product.reach = 1.0
    step = 1 / (127 if product.reduce_range else 255)
    assert (product(x)[:, 0] - x[:, 0]).abs().max() > 0.5 * step * 3.0


def test_the_activation_width_never_saturates_the_sums() -> None:
    """Every activation at the grid's top against weights of +127: the largest sums the
    kernels can meet. With the width chosen for this CPU (8 bits with VNNI, 7 on AVX2 alone)
    they come out exact; on AVX2 alone, 8 bits saturate fbgemm's 16-bit pair sums (the
    negative control, run where the CPU has no VNNI)."""
    quantized_engine()
    weight, x = torch.ones(16, 512), torch.ones(3, 512)
    assert activation_bits() == (8 if has_vnni() else 7)
    assert torch.allclose(Int8Linear(weight, None)(x), torch.full((3, 16), 512.0), rtol=1e-5)
    if not has_vnni():
        saturated = Int8Linear(weight, None, reduce_range=False)(x)
        assert (saturated - 512.0).abs().max() > 10.0


def decoder(path: Path, linear: type[Int8Linear] = Int8Linear, outliers: int = 0) -> Int8Decoder:
    quantized_engine()
    return Int8Decoder(load_causal_lm(str(path), torch.float32, torch.device("cpu")),
                       num_slots=6, slot_tokens=256, linear=linear, outliers=outliers)


@pytest.mark.parametrize("outliers", [0, 8])
def test_block_rows_equal_one_token_steps(outliers: int, qwen2: dict[str, Path]) -> None:
    assert block_layouts(decoder(qwen2["target"], outliers=outliers)) == {
        "k=2": True, "k=4": True, "k=8": True, "k=16": True, "beside another session": True}


def test_negative_control_a_shared_activation_range(qwen2: dict[str, Path]) -> None:
    same = block_layouts(decoder(qwen2["target"], SharedRangeLinear))
    assert not any(same.values()), same


def test_int8_follows_the_float_model(qwen2: dict[str, Path]) -> None:
    """Quantization moves the logits a little, not the model: most greedy tokens agree with
    float32 transformers on the same weights (a wrong layout, rotary or bias agrees on few)."""
    model = load_causal_lm(str(qwen2["target"]), torch.float32, torch.device("cpu"))
    ids = [int(t) for t in np.random.default_rng(7).integers(2, VOCAB, 64)]
    with torch.no_grad():
        reference = model(torch.tensor([ids])).logits[0]
    ours = rows_of(decoder(qwen2["target"]), [(0, 0, ids)], list(range(len(ids))))
    agree = (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()
    assert agree >= 0.85, agree
    assert (ours - reference).abs().max() < 0.1 * reference.abs().max()


def int8_settings(path: Path) -> Settings:
    return Settings(model=str(path), engine="int8", threads=1, max_draft_tokens=8,
                    max_context=256)  # type: ignore[arg-type]


PROMPTS = [[int(t) for t in ids] for ids in np.random.default_rng(5).integers(2, VOCAB, (6, 6))]
LONG = 48


def differ(url: str, drafter: Path, concurrent: int) -> list[str]:
    return speculative_vs_alone(url, drafter, str(drafter), PROMPTS, LONG, concurrent)


@pytest.fixture(scope="module")
def int8_server(qwen2: dict[str, Path]) -> LiveServer:
    with LiveServer(int8_settings(qwen2["target"])) as live:
        yield live  # type: ignore[misc]


@pytest.mark.parametrize("concurrent", [1, 5])
def test_greedy_speculation_equals_the_target_alone(concurrent: int, int8_server: LiveServer,
                                                    qwen2: dict[str, Path]) -> None:
    """At k = 1, 3, 8 and auto, alone and among 5 concurrent sessions, after the earlier
    sessions on the same verifier."""
    info = SpecDecClient(int8_server.url, None, tokenizer=str(qwen2["target"])).info
    assert (info.kernels, info.dtype) == ("exact", "int8")
    assert differ(int8_server.url, qwen2["drafter"], concurrent) == []


def test_greedy_speculation_with_outliers_equals_the_target_alone(
        qwen2: dict[str, Path]) -> None:
    settings = int8_settings(qwen2["target"]).model_copy(update={"int8_outliers": 8})
    with LiveServer(settings) as live:
        assert differ(live.url, qwen2["drafter"], 5) == []


def test_negative_control_a_shared_range_changes_greedy_output(qwen2: dict[str, Path]) -> None:
    settings = int8_settings(qwen2["target"])
    model = load_causal_lm(str(qwen2["target"]), torch.float32, torch.device("cpu"))
    tokenizer = load_tokenizer(str(qwen2["target"]))
    engine = Int8Engine(Int8Decoder(model, 8, 256, SharedRangeLinear), tokenizer,
                        eos_ids_of(model, tokenizer), str(qwen2["target"]), 8)
    with LiveServer(settings, engine) as live:
        assert differ(live.url, qwen2["drafter"], 5) != []


def test_the_engine_refuses_what_it_cannot_run(tmp_path: Path,
                                               tiny_models: dict[str, Path]) -> None:
    from shared.models.catalog import ModelSpecError

    with pytest.raises(ModelSpecError, match="int8 engine runs"):
        load_engine(int8_settings(tiny_models["gpt2-target"]))
    with pytest.raises(ValueError, match="int8 engine runs on the CPU"):
        Settings(model="x", engine="int8", device="cuda")  # type: ignore[arg-type]


@pytest.mark.parametrize("path", ["columns", "rows"])
def test_a_rows_outliers_skip_its_quantization(path: str) -> None:
    """A row whose one channel is 100x the others (the activations LLMs have): with its
    largest values taken out of the quantization, the rest are quantized on their own scale
    and the product stays close; with none taken out (the negative control), the outlier
    sets the scale and the small values round away."""
    quantized_engine()
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 256, generator=generator) * 0.05
    x = torch.randn(4, 256, generator=generator)
    x[:, 7] = 300.0
    exact = x.double() @ weight.double().T
    errors = {}
    for outliers in (8, 0):
        product = Int8Linear(weight, None, outliers=outliers, outlier_path=path)
        got = product(x).double()
        errors[outliers] = float((got - exact).norm() / exact.norm())
        assert all(torch.equal(product(x[r:r + 1])[0], product(x)[r]) for r in range(4))
    # 8-bit activations (VNNI): 3x and more; 7-bit (AVX2 alone) measured 2.8x (AMD EPYC)
    assert errors[8] < errors[0] / (3 if activation_bits() == 8 else 2), errors


@pytest.mark.parametrize("outliers", [0, 4])
def test_the_outliers_setting_reaches_every_linear_it_names(outliers: int,
                                                            qwen2: dict[str, Path]) -> None:
    settings = int8_settings(qwen2["target"]).model_copy(update={"int8_outliers": outliers})
    engine = load_engine(settings)
    assert isinstance(engine, Int8Engine)
    layer = engine.decoder.layers[0]
    assert [x.outliers for x in (layer.qkv, layer.out, layer.down, engine.decoder.head)] \
        == [outliers] * 4
    assert layer.gate_up.outliers == 0 and engine.decoder.head.outlier_path == "rows"
