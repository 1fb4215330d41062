"""The w4a8 engine computes every row as a one-token step computes it, on the GGUF's own bytes.

Its product (``kernels.cpp``) quantizes each row's activations alone, sums integers inside a
block and floats across blocks in one order whatever the row count; threads split output
columns, never a dot product. So a verify block's rows are bit-equal to one-token steps' at any
block length, beside other sessions and at any thread count, and greedy speculation equals the
target alone's. The negative control quantizes the activations with one scale for the whole
batch (what a naive batched W4A8 kernel does), which must fail the same checks.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from drafter_client import SpecDecClient
from shared.engines import resolve
from shared.engines.w4a8.build import choose_isa, library, packing, paths
from shared.engines.w4a8.gguf_file import MappedGGUF
from shared.engines.w4a8.model import Q4_K, Q6_K, GGUFFile, Matrix, W4A8Decoder, packed
from shared.engines.w4a8.target import W4A8Engine, eos_ids
from shared.machine_cache import cpu_flags
from shared.models.catalog import ModelSpecError, load_tokenizer
from tests.support.greedy import speculative_vs_alone, target_alone
from tests.support.live_server import LiveServer
from tests.support.row_layouts import block_layouts, rows_of
from tests.support.tiny_gguf import save_quantized_gguf, write_llama_gguf
from verifier_service.settings import Settings, load_engine

BLOCK_BYTES = {Q4_K: 144, Q6_K: 210}
ACT = np.dtype([("q", "i1", 256), ("sums", "<i2", 16), ("d", "<f4"),  # kernels/blocks.h's
                ("pad", "u1", 28)])  # ActBlock


@pytest.fixture(scope="module")
def q4k(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("w4a8")
    return {"target": save_quantized_gguf(root / "target", seed=0),
            "drafter": save_quantized_gguf(root / "drafter", seed=1)}


def random_matrix(kind: int, rows: int, cols: int, seed: int) -> Matrix:
    """A [rows, cols] matrix of random Q4_K or Q6_K blocks (any bytes are a block, but for
    the float16 scales, set here to small positive values)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // 256, BLOCK_BYTES[kind]), dtype=np.uint8)
    scales = rng.uniform(0.002, 0.02, (rows, cols // 256, 2)).astype(np.float16)
    where = slice(0, 4) if kind == Q4_K else slice(208, 210)
    blocks[:, :, where] = scales.view(np.uint8).reshape(rows, cols // 256, 4)[:, :, :where.stop
                                                                               - where.start]
    matrix = Matrix(f"random {kind}", kind, blocks.reshape(rows, -1), rows, cols)
    return packed(library(), matrix) if packing() else matrix


def activations(x: torch.Tensor, shared: bool = False) -> torch.Tensor:
    """The kernels' activation blocks of ``x`` [n, k], built here: each row's blocks scaled
    alone (what ``w4a8_quantize`` does), or, ``shared``, every row of a block column by the
    batch's largest value (the negative control)."""
    v = x.double().numpy().reshape(x.shape[0], -1, 256)
    amax = np.abs(v).max(axis=2, keepdims=True)
    if shared:
        amax = amax.max(axis=0, keepdims=True).repeat(x.shape[0], axis=0)
    d = (amax / 127.0).astype(np.float32)
    q = np.clip(np.rint(v.astype(np.float32) * (np.float32(127.0) / amax.astype(np.float32))),
                -127, 127).astype(np.int8)
    out = np.zeros(v.shape[:2], dtype=ACT)
    out["d"], out["q"] = d[..., 0], interleaved(q)
    out["sums"] = q.reshape(*v.shape[:2], 16, 16).astype(np.int32).sum(axis=3)
    return torch.from_numpy(out.view(np.uint8).reshape(-1).copy())


def interleaved(q: np.ndarray) -> np.ndarray:
    """[..., 256] values in order -> as the kernels keep them: each 64 as A[0:16] B[0:16]
    A[16:32] B[16:32] (A, B: its two 32-value halves)."""
    shape = q.shape
    return q.reshape(*shape[:-1], 4, 2, 2, 16).swapaxes(-3, -2).reshape(shape)


def in_order(q: np.ndarray) -> np.ndarray:
    shape = q.shape
    return q.reshape(*shape[:-1], 4, 2, 2, 16).swapaxes(-3, -2).reshape(shape)  # its inverse


def product(matrix: Matrix, act: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.empty(n, matrix.rows)
    pack = matrix.packed
    assert library().w4a8_matmul(matrix.type, matrix.address, matrix.nbytes,
                                 None if pack is None else pack.data_ptr(),
                                 0 if pack is None else pack.numel(), matrix.rows, matrix.cols,
                                 act.data_ptr(), act.numel(), n, None, out.data_ptr(),
                                 out.numel(), matrix.rows) == 0
    return out


@pytest.mark.parametrize("kind", [Q4_K, Q6_K])
def test_the_product_is_the_dequantized_weights_times_the_quantized_rows(kind: int) -> None:
    """Against gguf's own dequantization (an independent reading of the block layout) times
    the activations the kernel quantized, summed in float64: equal but for float rounding."""
    matrix = random_matrix(kind, 48, 512, seed=kind)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1))
    lib = library()
    act = torch.empty(5 * lib.w4a8_act_bytes(512), dtype=torch.uint8)
    assert lib.w4a8_quantize(x.data_ptr(), 5, 512, act.data_ptr(), act.numel()) == 0
    assert torch.equal(act, activations(x))  # the kernel quantizes as documented
    blocks = act.numpy().view(ACT).reshape(5, 2)
    rows = (in_order(blocks["q"]).astype(np.float64) * blocks["d"][..., None]).reshape(5, 512)
    weights = gguf.quants.dequantize(matrix.data, gguf.GGMLQuantizationType(kind))
    want = rows @ weights.astype(np.float64).T
    got = product(matrix, act, 5).double().numpy()
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def rows_differ(matrix: Matrix, x: torch.Tensor, shared: bool = False) -> list[int]:
    """The rows of ``x`` whose product in one call differs from the row's product alone."""
    together = product(matrix, activations(x, shared), len(x))
    alone = [product(matrix, activations(x[r:r + 1], shared), 1)[0] for r in range(len(x))]
    return [r for r in range(len(x)) if not torch.equal(together[r], alone[r])]


@pytest.mark.parametrize("threads", [1, 2, 3, 4, 8, 16])
def test_a_rows_product_does_not_depend_on_the_rows_beside_it(threads: int) -> None:
    """The 1.5B's widths (1,536 and 8,960 inputs), 17 rows of very different sizes: each row
    bit-equal alone and among them (tiles of 8, 8 and 1), at every thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(threads)
        for kind, cols in ((Q4_K, 1536), (Q6_K, 8960)):
            matrix = random_matrix(kind, 40, cols, seed=cols)
            x = torch.randn(17, cols, generator=generator) * torch.rand(17, 1) * 8
            assert rows_differ(matrix, x) == [], (kind, cols)
    finally:
        torch.set_num_threads(before)


def test_negative_control_a_shared_activation_scale() -> None:
    matrix = random_matrix(Q4_K, 40, 1536, seed=0)
    x = torch.randn(17, 1536, generator=torch.Generator().manual_seed(0)) * \
        torch.linspace(0.1, 8, 17)[:, None]
    assert len(rows_differ(matrix, x, shared=True)) >= 15


# Each SIMD path and the CPU flags it needs (lscpu's names); the portable path runs anywhere.
SIMD_PATHS = {"avx2": ("avx2", "fma", "f16c"),
              "avx-vnni": ("avx2", "fma", "f16c", "avx_vnni"),
              "avx512-vnni-256": ("avx512f", "avx512vl", "avx512_vnni"),
              "avx512-vnni": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")}


def test_the_library_holds_every_path() -> None:
    assert list(paths()) == ["portable", *SIMD_PATHS]
    assert paths()["portable"]


def on_path(name: str) -> None:
    """Use path ``name`` for the calls that follow, or skip naming the flags this CPU lacks."""
    missing = [flag for flag in SIMD_PATHS.get(name, ()) if flag not in cpu_flags()]
    if missing:
        pytest.skip(f"the {name} path needs {', '.join(missing)}, which this CPU lacks")
    choose_isa(name)


@pytest.fixture
def restore_isa() -> Iterator[None]:
    yield
    choose_isa(None)


@pytest.mark.parametrize("name", list(SIMD_PATHS))
def test_every_path_agrees_with_the_portable_one_bit_for_bit(name: str,
                                                             restore_isa: None) -> None:
    """Quantization, Q4_K and Q6_K products on the 1.5B's widths at 1-9 and 17 rows and an odd
    column count, SiLU and exp: each path's bits are the portable path's."""
    lib = library()
    x = torch.randn(17, 8960, generator=torch.Generator().manual_seed(2)) * 3
    x[0, :256] = 0.0  # an all-zero block
    x[1, 5] = 1e4  # a block ruled by one value
    results = {}
    for path in ("portable", name):
        on_path(path)
        out: list[torch.Tensor] = []
        for cols in (1536, 8960):
            act = torch.empty(17 * lib.w4a8_act_bytes(cols), dtype=torch.uint8)
            rows = x[:, :cols].contiguous()
            assert lib.w4a8_quantize(rows.data_ptr(), 17, cols, act.data_ptr(), act.numel()) == 0
            out.append(act)
            for kind in (Q4_K, Q6_K):
                matrix = random_matrix(kind, 23, cols, seed=kind + cols)
                for n in (*range(1, 10), 17):
                    out.append(product(matrix, act[:n * lib.w4a8_act_bytes(cols)], n))
        gate_up = x[:4].contiguous()
        silu = torch.empty(4, 4480)
        assert lib.w4a8_silu_mul(gate_up.data_ptr(), 4, 4480, silu.data_ptr()) == 0
        out.append(silu)
        results[path] = out
    assert torch.equal(results["portable"][0], activations(x[:, :1536]))
    for ours, theirs in zip(results[name], results["portable"], strict=True):
        assert torch.equal(ours, theirs)


def test_negative_control_the_same_sums_in_another_order_give_other_bits() -> None:
    """What the path test would catch: the same products added in float32 in another order
    (numpy's matmul of the dequantized weights) agree to rounding but not bit for bit."""
    matrix = random_matrix(Q4_K, 64, 1536, seed=3)
    x = torch.randn(4, 1536, generator=torch.Generator().manual_seed(4))
    act = activations(x)
    blocks = act.numpy().view(ACT).reshape(4, 6)
    rows = (in_order(blocks["q"]).astype(np.float32) * blocks["d"][..., None]).reshape(4, 1536)
    weights = gguf.quants.dequantize(matrix.data, gguf.GGMLQuantizationType(Q4_K))
    theirs = rows @ weights.astype(np.float32).T
    ours = product(matrix, act, 4).numpy()
    assert np.allclose(ours, theirs, rtol=1e-4, atol=1e-4 * np.abs(theirs).max())
    assert not np.array_equal(ours, theirs)


def test_silu_follows_torch_within_its_rounding() -> None:
    """Our own exp (blocks.h's exp_fixed) inside SiLU: within a few float32 ulps of torch's."""
    lib = library()
    gate_up = torch.linspace(-90, 90, 2 * 40000).reshape(1, -1).contiguous()
    ours = torch.empty(1, 40000)
    assert lib.w4a8_silu_mul(gate_up.data_ptr(), 1, 40000, ours.data_ptr()) == 0
    gate, up = gate_up[:, :40000].double(), gate_up[:, 40000:].double()
    want = gate * torch.sigmoid(gate) * up
    assert torch.allclose(ours.double(), want, rtol=4e-7, atol=1e-30)


# -- the decoder on a real Q4_K_M file (llama.cpp quantized it) ---------------------------------

class SharedScaleDecoder(W4A8Decoder):
    """The negative control: each block column of a forward's rows quantized by one scale."""

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        return activations(x, shared=True)


def decoder(path: Path, kind: type[W4A8Decoder] = W4A8Decoder) -> W4A8Decoder:
    return kind(GGUFFile(path), num_slots=6, slot_tokens=256)


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_block_rows_equal_one_token_steps(threads: int, q4k: dict[str, Path]) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert all(block_layouts(decoder(q4k["target"])).values())
    finally:
        torch.set_num_threads(before)


def rows_in_chunks(model: W4A8Decoder, ids: list[int], n: int, slot: int) -> torch.Tensor:
    """A prompt written ``n`` rows a forward into ``slot``: every row's logits."""
    return torch.cat([rows_of(model, [(slot, at, ids[at:at + n])], list(range(len(ids[at:at + n]))))
                      for at in range(0, len(ids), n)])


def row_counts_that_differ(model: W4A8Decoder) -> list[int]:
    ids = [int(t) for t in np.random.default_rng(11).integers(2, 256, 64)]
    steps = rows_in_chunks(model, ids, 1, 0)
    return [n for n in range(2, 65) if not torch.equal(rows_in_chunks(model, ids, n, n % 5 + 1),
                                                       steps)]


def test_every_row_count_from_1_to_64_gives_the_one_token_steps_bits(
        q4k: dict[str, Path]) -> None:
    """64 rows written n at a time, n = 1..64 (tiles of 4, a last short tile, panels of 16
    columns): every row bit-equal to its one-token step."""
    assert row_counts_that_differ(decoder(q4k["target"])) == []


def test_negative_control_a_shared_scale_differs_at_some_row_counts(
        q4k: dict[str, Path]) -> None:
    assert len(row_counts_that_differ(decoder(q4k["target"], SharedScaleDecoder))) > 30


def test_negative_control_a_shared_activation_scale_in_the_decoder(
        q4k: dict[str, Path]) -> None:
    same = block_layouts(decoder(q4k["target"], SharedScaleDecoder))
    assert not any(same.values()), same


def test_w4a8_follows_llama_cpp_on_the_same_file(q4k: dict[str, Path]) -> None:
    """The same weights and the same kind of product as llama.cpp's: its logits within a few
    percent of llama.cpp's (a wrong block layout, rotary pairing or bias is far off)."""
    from shared.engines.llama_cpp.runtime import LlamaModel, Segment

    ids = [int(t) for t in np.random.default_rng(7).integers(2, 256, 48)]
    ours = rows_of(decoder(q4k["target"]), [(0, 0, ids)], list(range(len(ids)))).numpy()
    llama = LlamaModel(str(q4k["target"]), n_seqs=1, seq_tokens=64, threads=1)
    try:
        [theirs] = llama.decode([Segment(0, 0, ids, 0)])
    finally:
        llama.close()
    assert theirs is not None
    spread = theirs.std()
    assert np.abs(ours - theirs).max() < 0.1 * spread + 0.02 * np.abs(theirs).max(), \
        (np.abs(ours - theirs).max(), spread)
    assert np.corrcoef(ours.ravel(), theirs.ravel())[0, 1] > 0.99


# -- the served engine -------------------------------------------------------------------------

PROMPTS = [[int(t) for t in ids] for ids in np.random.default_rng(5).integers(2, 256, (7, 6))]
LONG = 40


def w4a8_settings(path: Path) -> Settings:
    return Settings(model=str(path), engine="w4a8", threads=1, max_draft_tokens=8,
                    max_context=256)  # type: ignore[arg-type]


def differ(url: str, drafter: Path, loads: tuple[int, ...],
           want: list[list[int]] | None = None) -> list[str]:
    return speculative_vs_alone(url, drafter, str(drafter), PROMPTS, LONG, loads, want=want)


@pytest.fixture(scope="module")
def w4a8_server(q4k: dict[str, Path]) -> LiveServer:
    with LiveServer(w4a8_settings(q4k["target"])) as live:
        yield live  # type: ignore[misc]


@pytest.fixture(scope="module")
def w4a8_alone(w4a8_server: LiveServer, q4k: dict[str, Path]) -> list[list[int]]:
    return target_alone(w4a8_server.url, str(q4k["drafter"]), PROMPTS, LONG)


@pytest.mark.parametrize("sessions", [1, 3, 7])
def test_greedy_speculation_equals_the_target_alone(sessions: int, w4a8_server: LiveServer,
                                                    q4k: dict[str, Path],
                                                    w4a8_alone: list[list[int]]) -> None:
    """Each prompt alone at k = 1, 3, 8 and auto (1), or 3 or 7 sessions at once."""
    info = SpecDecClient(w4a8_server.url, None, tokenizer=str(q4k["target"])).info
    assert info.kernels == "exact" and info.dtype.startswith("gguf w4a8")
    assert differ(w4a8_server.url, q4k["drafter"], (sessions,), w4a8_alone) == []


def engine_of(path: Path, decoder: type[W4A8Decoder] = W4A8Decoder,
              engine: type[W4A8Engine] = W4A8Engine, slots: int = 8) -> W4A8Engine:
    """A w4a8 engine on ``path`` built from these classes (a test's changed decoder or
    engine), ``slots`` sessions of 256 tokens."""
    file = GGUFFile(path)
    tokenizer = load_tokenizer(str(path))
    model = decoder(file, slots, 256)
    return engine(model, tokenizer, eos_ids(file, tokenizer, model.shape.vocab), str(path),
                  slots)


def test_negative_control_a_shared_scale_changes_greedy_output(q4k: dict[str, Path]) -> None:
    engine = engine_of(q4k["target"], decoder=SharedScaleDecoder)
    with LiveServer(w4a8_settings(q4k["target"]), engine) as live:
        assert differ(live.url, q4k["drafter"], (1, 7)) != []


# -- what auto picks, what the engine refuses ----------------------------------------------------

def test_auto_picks_w4a8_for_a_q4_k_m_file_and_llama_cpp_for_others(
        q4k: dict[str, Path], tmp_path: Path) -> None:
    assert resolve("auto", str(q4k["target"]), "cpu").name == "w4a8"
    plain = write_llama_gguf(q4k["target"].parent, tmp_path / "f32.gguf")  # float32 matrices
    assert resolve("auto", str(plain), "cpu").name == "llama-cpp"
    with pytest.raises(ModelSpecError, match="Q4_K and Q6_K.*--engine llama-cpp"):
        load_engine(w4a8_settings(plain))


@pytest.mark.parametrize("damage", ["truncated", "not gguf", "missing"])
def test_a_damaged_file_is_a_one_line_error(damage: str, q4k: dict[str, Path],
                                            tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    data = q4k["target"].read_bytes()
    if damage == "truncated":
        bad.write_bytes(data[:len(data) // 2])
    elif damage == "not gguf":
        bad.write_bytes(b"GGML" + data[4:])
    with pytest.raises(ModelSpecError) as error:
        load_engine(w4a8_settings(bad))
    assert "\n" not in str(error.value)
    assert resolve("auto", str(bad), "cpu").name != "w4a8"


def test_the_header_reader_agrees_with_gguf_py(q4k: dict[str, Path]) -> None:
    ours = MappedGGUF(q4k["target"])
    theirs = gguf.GGUFReader(str(q4k["target"]))
    for tensor in theirs.tensors:
        info = ours.tensors[tensor.name]
        assert info.type == int(tensor.tensor_type)
        assert list(info.shape) == [int(x) for x in tensor.shape]
        assert np.array_equal(ours.data(tensor.name), np.asarray(tensor.data).view(np.uint8)
                              .reshape(-1))
    assert ours.fields["llama.block_count"] == theirs.fields["llama.block_count"].contents()
    assert struct.unpack("<I", q4k["target"].read_bytes()[4:8])[0] in (2, 3)


def test_the_engine_runs_on_the_cpu_only() -> None:
    with pytest.raises(ValueError, match="w4a8 engine runs on the CPU"):
        Settings(model="x", engine="w4a8", device="cuda")  # type: ignore[arg-type]
