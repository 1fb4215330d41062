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
from tests.support.greedy import speculative_vs_alone, target_alone
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


def differ(url: str, drafter: Path, loads: tuple[int, ...],
           want: list[list[int]] | None = None) -> list[str]:
    return speculative_vs_alone(url, drafter, str(drafter), PROMPTS, LONG, loads, want=want)


@pytest.fixture(scope="module")
def int8_server(qwen2: dict[str, Path]) -> LiveServer:
    with LiveServer(int8_settings(qwen2["target"])) as live:
        yield live  # type: ignore[misc]


@pytest.fixture(scope="module")
def int8_alone(int8_server: LiveServer, qwen2: dict[str, Path]) -> list[list[int]]:
    return target_alone(int8_server.url, str(qwen2["drafter"]), PROMPTS, LONG)


@pytest.mark.parametrize("sessions", [1, 5])
def test_greedy_speculation_equals_the_target_alone(sessions: int, int8_server: LiveServer,
                                                    qwen2: dict[str, Path],
                                                    int8_alone: list[list[int]]) -> None:
    """At k = 1, 3, 8 and auto, each prompt alone (1) or 5 sessions at once, after the earlier
    sessions on the same verifier."""
    info = SpecDecClient(int8_server.url, None, tokenizer=str(qwen2["target"])).info
    assert (info.kernels, info.dtype) == ("exact", "int8")
    assert differ(int8_server.url, qwen2["drafter"], (sessions,), int8_alone) == []


@pytest.mark.slow  # a server of its own, every k and 5 sessions
def test_greedy_speculation_with_outliers_equals_the_target_alone(
        qwen2: dict[str, Path]) -> None:
    settings = int8_settings(qwen2["target"]).model_copy(update={"int8_outliers": 8})
    with LiveServer(settings) as live:
        assert differ(live.url, qwen2["drafter"], (1, 5)) == []


def test_negative_control_a_shared_range_changes_greedy_output(qwen2: dict[str, Path]) -> None:
    settings = int8_settings(qwen2["target"])
    model = load_causal_lm(str(qwen2["target"]), torch.float32, torch.device("cpu"))
    tokenizer = load_tokenizer(str(qwen2["target"]))
    engine = Int8Engine(Int8Decoder(model, 8, 256, SharedRangeLinear), tokenizer,
                        eos_ids_of(model, tokenizer), str(qwen2["target"]), 8)
    with LiveServer(settings, engine) as live:
        assert differ(live.url, qwen2["drafter"], (1, 5)) != []


def test_the_engine_refuses_what_it_cannot_run(tmp_path: Path,
                                               tiny_models: dict[str, Path]) -> None:
    from shared.models.catalog import ModelSpecError

    with pytest.raises(ModelSpecError, match="int8 engine runs"):
        load_engine(int8_settings(tiny_models["gpt2-target"]))
    with pytest.raises(ValueError, match="int8 engine runs on the CPU"):
        Settings(model="x", engine="int8", device="cuda")  # type: ignore[arg-type]


def test_the_engine_refuses_a_model_whose_tensors_it_would_leave_out(tmp_path: Path) -> None:
    """A Qwen3 (query and key norms) labelled Qwen2, and a Llama with MLP biases: both loaded
    and ran as another model before; the Qwen2 they pose as loads (the control)."""
    import json

    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from shared.engines.int8 import can_serve
    from shared.models.catalog import ModelSpecError
    from tests.support.tiny_models import build_tokenizer

    small = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
             "eos_token_id": 1, "bos_token_id": 1}
    qwen3 = tmp_path / "qwen3-as-qwen2"
    Qwen3ForCausalLM(Qwen3Config(**small, head_dim=8)).save_pretrained(qwen3)
    config = json.loads((qwen3 / "config.json").read_text())
    config.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    (qwen3 / "config.json").write_text(json.dumps(config))
    llama = tmp_path / "llama-mlp-bias"
    LlamaForCausalLM(LlamaConfig(**small, mlp_bias=True)).save_pretrained(llama)
    plain = save_tiny_qwen2(tmp_path / "qwen2", 64)
    for folder in (qwen3, llama):
        build_tokenizer(64).save_pretrained(folder)
    with pytest.raises(ModelSpecError, match=r"leave out 2 tensors .*q_norm"):
        load_engine(int8_settings(qwen3))
    with pytest.raises(ModelSpecError, match="no mlp_bias"):
        load_engine(int8_settings(llama))
    assert [can_serve(str(f)) for f in (qwen3, llama, plain)] == [False, False, True]
    assert load_engine(int8_settings(plain)).info.dtype == "int8"


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


def int8_engine(path: Path, chunk_rows: int, slot_tokens: int = 256) -> Int8Engine:
    model = load_causal_lm(str(path), torch.float32, torch.device("cpu"))
    tokenizer = load_tokenizer(str(path))
    engine = Int8Engine(decoder_of(model, slot_tokens), tokenizer,
                        eos_ids_of(model, tokenizer), str(path), 4)
    engine.chunk_rows = chunk_rows
    return engine


def decoder_of(model: Any, slot_tokens: int) -> Int8Decoder:
    quantized_engine()
    return Int8Decoder(model, num_slots=4, slot_tokens=slot_tokens)


def test_a_prompt_in_chunks_writes_what_one_forward_writes(qwen2: dict[str, Path]) -> None:
    """A prompt of 61 tokens beside another session's 23 in one forward, in chunks of 7 rows
    (boundaries inside both), against the same forward in one piece: every logits row, every
    key and value written, and the one-token steps after it are bit-equal."""
    from shared.engines.target import ForwardItem

    rng = np.random.default_rng(11)
    prompt, other = ([int(t) for t in rng.integers(2, VOCAB, n)] for n in (61, 23))
    results = []
    for chunk_rows in (7, 1 << 20):
        engine = int8_engine(qwen2["target"], chunk_rows)
        rows = engine.forward([ForwardItem(1, 0, other, True, keep_from=20),
                               ForwardItem(0, 0, prompt, True)])
        steps, token = [], int(rows[1][-1].argmax())  # type: ignore[index]
        for position in range(len(prompt), len(prompt) + 12):
            row = engine.forward([ForwardItem(0, position, [token], True)])[0]
            assert row is not None
            steps.append(row[0])
            token = int(row[0].argmax())
        written = [(0, len(prompt) + 12), (1, len(other))]  # the rest is never written
        results.append((rows, *(torch.cat([kv[:, slot, :, :n].flatten() for slot, n in written])
                                for kv in (engine.decoder.keys, engine.decoder.values)),
                        torch.stack(steps)))
    (chunked, keys, values, steps), (whole, *reference) = results
    assert [r.shape[0] for r in chunked] == [3, 61]  # type: ignore[union-attr]
    assert all(torch.equal(a, b) for a, b in zip(chunked, whole, strict=True))  # type: ignore[arg-type]
    assert all(torch.equal(a, b) for a, b in zip((keys, values, steps), reference, strict=True))


def test_no_forward_holds_more_than_a_chunk_of_rows(qwen2: dict[str, Path]) -> None:
    """A 1,500-token prompt (a first job the scheduler admits whole) reaches the decoder 256
    rows at a time, so its activations are a chunk's, not the prompt's; before chunks it
    went whole (the negative control: what the old engine did, one decoder call)."""
    from shared.engines.target import ForwardItem

    engine = int8_engine(qwen2["target"], 256, slot_tokens=1600)
    assert engine.chunk_rows == 256  # the engine's default
    seen: list[int] = []
    forward = engine.decoder.forward

    def counted(rows: Any, keep: torch.Tensor) -> torch.Tensor:
        seen.append(len(rows.slots))
        return forward(rows, keep)

    engine.decoder.forward = counted  # type: ignore[method-assign]
    prompt = [int(t) for t in np.random.default_rng(2).integers(2, VOCAB, 1500)]
    [row] = engine.forward([ForwardItem(0, 0, prompt, True, keep_from=1499)])
    assert row is not None and row.shape == (1, VOCAB)
    assert seen == [256] * 5 + [220], seen
    engine.chunk_rows = 1 << 20
    engine.forward([ForwardItem(1, 0, prompt, True, keep_from=1499)])
    assert seen[-1] == 1500


def test_a_slots_rows_go_in_position_order(qwen2: dict[str, Path]) -> None:
    """Chunks keep a forward's meaning only if no row reads a position written after it in the
    same forward: an item that starts before an earlier item of its slot ends is refused."""
    from shared.engines.target import ForwardItem

    engine = int8_engine(qwen2["target"], 4)
    engine.forward([ForwardItem(0, 0, [5, 6, 7], False), ForwardItem(0, 3, [8, 9], True)])
    with pytest.raises(ValueError, match="position order"):
        engine.forward([ForwardItem(0, 3, [8, 9], True), ForwardItem(0, 0, [5, 6, 7], False)])


# -- every elementwise step row-invariant at any thread count (SiLU: one call per row)


def old_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The negative control: SiLU over the whole [n, w] in one call, as before."""
    gate, up = gate_up.chunk(2, dim=1)
    return torch.nn.functional.silu(gate) * up


@pytest.fixture
def threads() -> Any:
    """Restores the test process's thread count after a test that sets its own."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def rows_differing(op: Any, width: int, counts: range, seed: int) -> int:
    """Rows of ``op`` over [n, width] (n in ``counts``) that differ from the row alone."""
    generator = torch.Generator().manual_seed(seed)
    differing = 0
    for n in counts:
        x = torch.randn(n, width, generator=generator) * 3
        whole = op(x.clone())
        differing += sum(not torch.equal(whole[r], op(x[r:r + 1].clone())[0]) for r in range(n))
    return differing


@pytest.mark.parametrize("count", [1, 2, 3, 4, 8])
def test_silu_rows_do_not_depend_on_the_thread_split(count: int, threads: Any) -> None:
    """SiLU x up over Qwen2.5-1.5B's and 0.5B's MLP widths (8,960 and 4,864), 1 to 40 rows:
    each row of a call equals the row alone, at 1, 2, 3, 4 and 8 threads. The negative
    control is the old call over the whole [n, w]: at 3 threads ATen ends a thread's share
    inside a row and SiLU's scalar tail rounds otherwise (measured here: rows differ at 3, 4
    and 8 threads, none at 1 or 2)."""
    from shared.engines.int8.kernels import silu_mul

    threads(count)
    for width in (2 * 8960, 2 * 4864):
        assert rows_differing(silu_mul, width, range(1, 41), seed=width) == 0
    if count == 3:
        assert sum(rows_differing(old_silu_mul, width, range(1, 41), seed=width)
                   for width in (2 * 8960, 2 * 4864)) > 0


@pytest.mark.parametrize("count", [3, 4, 8])
def test_the_other_elementwise_steps_do_not_depend_on_the_thread_split(
        count: int, threads: Any) -> None:
    """RMSNorm (a sum along the row), residual adds and rotary embeddings at real widths
    (hidden 1,536 and 896; 12 heads of 128): each row of a call equals the row alone."""
    from shared.engines.int8.kernels import rms_norm
    from shared.engines.int8.model import _rotate

    threads(count)
    for hidden in (1536, 896):
        norm = functools.partial(rms_norm, weight=torch.rand(hidden) + 0.5, eps=1e-6)
        half = hidden // 2
        assert rows_differing(norm, hidden, range(1, 41), seed=hidden) == 0
        assert rows_differing(lambda x, h=half: x[:, :h] + x[:, h:], hidden, range(1, 41),
                              seed=hidden + 1) == 0

    def rotate(x: torch.Tensor) -> torch.Tensor:  # x: a row's values, then its cos and sin
        n, values = x.shape[0], x[:, :12 * 128].reshape(x.shape[0], 12, 128)
        cos, sin = x[:, None, 12 * 128:13 * 128], x[:, None, 13 * 128:]
        return _rotate(values, cos, sin).view(n, -1)

    assert rows_differing(rotate, 14 * 128, range(1, 41), seed=7) == 0


class Recorded(Int8Linear):
    """An int8 linear that keeps what it was given: every elementwise step's output reaches a
    linear (the norms, attention's sum, SiLU x up), so its input rows are the decoder's rows
    at each step."""

    calls: list[tuple[Int8Linear, torch.Tensor]] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        Recorded.calls.append((self, x.clone()))
        return super().__call__(x)


def real_width_decoder() -> Int8Decoder:
    """One Qwen2 layer of Qwen2.5-1.5B's widths (hidden 1,536, MLP 8,960, 12 heads and 2 KV
    heads of 128), random weights, a 256-token vocabulary, every linear recorded."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=1, num_attention_heads=12, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False,
                         architectures=["Qwen2ForCausalLM"])
    model = Qwen2ForCausalLM(config).eval()
    quantized_engine()
    return Int8Decoder(model, num_slots=4, slot_tokens=64, linear=Recorded)


def step_rows(decoder: Int8Decoder, layout: list[list[tuple[int, int, list[int]]]],
              slot: int) -> dict[tuple[int, int], torch.Tensor]:
    """Each forward of ``layout`` (segments of ``(slot, start, tokens)``, logits kept for
    every row): the input row of every linear for ``slot``'s positions, by (linear, position)."""
    from tests.support.row_layouts import rows_of

    names = {id(decoder.head): 0}
    for i, layer in enumerate(decoder.layers):
        names.update({id(x): 1 + 4 * i + j for j, x in
                      enumerate((layer.qkv, layer.out, layer.gate_up, layer.down))})
    got = {}
    for segments in layout:
        Recorded.calls.clear()
        n = sum(len(tokens) for _, _, tokens in segments)
        rows_of(decoder, segments, list(range(n)))
        where = [(s, start + i) for s, start, tokens in segments for i in range(len(tokens))]
        for linear, x in Recorded.calls:
            for r, (s, position) in enumerate(where):
                if s == slot:
                    got[names[id(linear)], position] = x[r]
    return got


TOKENS = [int(t) for t in np.random.default_rng(9).integers(2, VOCAB, 40)]


def layouts_differing(decoder: Int8Decoder) -> dict[str, int]:
    """Rows of every linear's input that differ from one-token steps, for each layout: the
    first 12 tokens as a prompt then blocks of 5, beside another session's 6 rows; blocks of
    11; the 40 tokens at once."""
    reference = step_rows(decoder, [[(0, i, [t])] for i, t in enumerate(TOKENS)], 0)
    blocks = {
        "12 + blocks of 5 beside 6": [[(2, 0, TOKENS[:6]), (1, 0, TOKENS[:12])]] + [
            [(2, 6 + 6 * j, TOKENS[:6]), (1, at, TOKENS[at:at + 5])]
            for j, at in enumerate(range(12, 40, 5))],
        "blocks of 11": [[(1, at, TOKENS[at:at + 11])] for at in range(0, 40, 11)],
        "40 at once": [[(1, 0, TOKENS)]],
    }
    differing = {}
    for name, layout in blocks.items():
        got = step_rows(decoder, layout, 1)
        assert got.keys() == reference.keys()
        differing[name] = sum(not torch.equal(got[key], reference[key]) for key in reference)
    return differing


@pytest.mark.parametrize("count", [3, 4, 8])
def test_every_decoder_row_equals_one_token_steps_at_any_thread_count(
        count: int, threads: Any) -> None:
    """At real widths and 3, 4 and 8 threads, each row entering every linear of the decoder
    (after RMSNorm, attention, SiLU x up; the final norm before the head) and so each logits
    row, in a prompt, in verify blocks and beside another session, is bit-equal to the
    one-token step's at that position."""
    threads(count)
    assert layouts_differing(real_width_decoder()) == {
        "12 + blocks of 5 beside 6": 0, "blocks of 11": 0, "40 at once": 0}


def test_negative_control_one_silu_call_over_the_block(threads: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The same check with SiLU over the whole [n, 8,960] at 3 threads (the old decoder): the
    down projection's input rows of a block differ from one-token steps'."""
    import shared.engines.int8.model as model

    threads(3)
    monkeypatch.setattr(model, "silu_mul", old_silu_mul)
    differing = layouts_differing(real_width_decoder())
    assert sum(differing.values()) > 0, differing
