"""The CPU matrix kernels a cheap-block verifier could run on, side by side, on the target's shapes.

For each candidate it times the linear layers of a decoder (``--copies`` distinct layers of the
target's shape, each its qkv, output, gate/up and down products, so the weights stream from
memory as a real forward's do) and the output head, at 1-32 rows, every round in rotating order,
and prices a whole forward from them (``layers`` x the layer + the head). It also checks what
the verifier's exactness needs: is a row's result **bit-equal whatever rows sit beside it**
(each row count against the same rows one at a time)? A kernel that fails it can serve a
speculative verifier only with greedy output that drifts from the target alone's.

Candidates (those whose package is missing are listed as skipped):

* ``fbgemm rows alone, 7-bit`` / ``8-bit``: the int8 engine's ``Int8Linear`` (each row quantized
  alone, ``reduce_range`` on / off);
* ``fbgemm shared range``: what ``torch.ao.quantization.quantize_dynamic`` runs (one activation
  range for the batch);
* ``float32`` / ``bfloat16``: ``torch.nn.functional.linear`` (oneDNN / MKL);
* ``int8 weights, float math``: ``torch.ops.aten._weight_int8pack_mm`` (the CPU op behind
  torchao's int8 weight-only layout);
* ``torch._int_mm, rows alone``: int8 x int8 -> int32, each row quantized alone (symmetric);
* ``onnxruntime MatMulInteger, rows alone``: MLAS's u8 x s8 GEMM, each row quantized alone;
* ``onnxruntime MatMulNBits int4``: 4-bit weights in blocks of 32 with int8 activations per
  block (``accuracy_level`` 4; llama.cpp's Q4_0 x Q8_0 scheme).

The error column is each candidate's relative error against float64 on Gaussian inputs: a rough
guide to the arithmetic, not the model's quality (real activations have outlier channels).

    python -m scripts.bench cpu-kernels --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from scripts.bench.common import markdown_table, write_json
from shared.engines.int8.kernels import Int8Linear, SharedRangeLinear, quantized_engine
from shared.machine_cache import cpu_flags

# Qwen2.5-Coder-1.5B: hidden 1536, 12 heads of 128 with 2 KV heads, MLP 8960, vocab 151,936
SHAPES = {"hidden": 1536, "qkv": 2048, "intermediate": 8960, "vocab": 151936, "layers": 28}

Apply = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Candidate:
    name: str
    build: Callable[[torch.Tensor], Apply]  # float32 weight [out, in] -> x [m, in] -> [m, out]
    bytes_per_weight: float


def _fbgemm(reduce_range: bool) -> Callable[[torch.Tensor], Apply]:
    def build(w: torch.Tensor) -> Apply:
        return Int8Linear(w, None, reduce_range=reduce_range)
    return build


def _fbgemm_shared(w: torch.Tensor) -> Apply:
    return SharedRangeLinear(w, None, reduce_range=True)


def _float32(w: torch.Tensor) -> Apply:
    return lambda x: torch.nn.functional.linear(x, w)


def _bfloat16(w: torch.Tensor) -> Apply:
    wb = w.bfloat16()
    return lambda x: torch.nn.functional.linear(x.bfloat16(), wb).float()


def _symmetric_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output channel: int8 [out, in] and float32 scales [out]."""
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    return torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


def _int8pack(w: torch.Tensor) -> Apply:
    q, scales = _symmetric_int8(w)
    return lambda x: torch.ops.aten._weight_int8pack_mm(x, q, scales)


def _rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row quantized alone, symmetric: int8 [m, in] and scales [m, 1]."""
    amax = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
    return torch.round(x * (127.0 / amax)).to(torch.int8), amax / 127.0


def _int_mm(w: torch.Tensor) -> Apply:
    q, scales = _symmetric_int8(w)
    qt = q.t().contiguous().t()  # [in, out] view of a column-major copy, as _int_mm prefers

    def apply(x: torch.Tensor) -> torch.Tensor:
        xq, xs = _rows_int8(x)
        return torch._int_mm(xq, qt.t()).float() * xs * scales
    return apply


def _ort_session(graph: Any) -> Any:
    import onnx
    import onnxruntime as ort
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21),
                                                         onnx.helper.make_opsetid(
                                                             "com.microsoft", 1)])
    model.ir_version = 10
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.inter_op_num_threads = 1
    # its pool's threads would otherwise spin after each run, taking the cores from the
    # candidate timed next
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def _ort_matmul_integer(w: torch.Tensor) -> Apply:
    from onnx import TensorProto, helper, numpy_helper
    q, scales = _symmetric_int8(w)
    out_features, in_features = w.shape
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["A", "B", "a_zero"], ["Y"])], "mmi",
        [helper.make_tensor_value_info("A", TensorProto.UINT8, ["m", in_features])],
        [helper.make_tensor_value_info("Y", TensorProto.INT32, ["m", out_features])],
        [numpy_helper.from_array(q.t().contiguous().numpy(), "B"),
         numpy_helper.from_array(np.array(128, dtype=np.uint8), "a_zero")])
    session = _ort_session(graph)

    def apply(x: torch.Tensor) -> torch.Tensor:
        xq, xs = _rows_int8(x)
        a = (xq.to(torch.int16) + 128).to(torch.uint8).numpy()
        y = session.run(None, {"A": a})[0]
        return torch.from_numpy(y).float() * xs * scales
    return apply


def _ort_int4(w: torch.Tensor, block: int = 32) -> Apply:
    from onnx import TensorProto, helper, numpy_helper
    out_features, in_features = w.shape
    blocks = w.reshape(out_features, in_features // block, block)
    scales = (blocks.abs().amax(dim=2) / 7.0).clamp_min(1e-12)  # [out, k_blocks]
    q = (torch.round(blocks / scales[..., None]).clamp(-8, 7) + 8).to(torch.uint8)
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()  # low nibble first
    graph = helper.make_graph(
        [helper.make_node("MatMulNBits", ["A", "B", "scales"], ["Y"], domain="com.microsoft",
                          K=in_features, N=out_features, bits=4, block_size=block,
                          accuracy_level=4)], "mmnbits",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["m", in_features])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["m", out_features])],
        [numpy_helper.from_array(packed.numpy(), "B"),
         numpy_helper.from_array(scales.reshape(-1).numpy(), "scales")])
    session = _ort_session(graph)
    return lambda x: torch.from_numpy(session.run(None, {"A": x.numpy()})[0])


def candidates() -> tuple[list[Candidate], dict[str, str]]:
    """The candidates this machine can run, and why the others are skipped."""
    quantized_engine()
    found = [Candidate("fbgemm rows alone, 7-bit", _fbgemm(True), 1),
             Candidate("fbgemm rows alone, 8-bit", _fbgemm(False), 1),
             Candidate("fbgemm shared range (quantize_dynamic)", _fbgemm_shared, 1),
             Candidate("float32", _float32, 4), Candidate("bfloat16", _bfloat16, 2),
             Candidate("int8 weights, float math (_weight_int8pack_mm)", _int8pack, 1),
             Candidate("torch._int_mm, rows alone", _int_mm, 1)]
    skipped = {}
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
        found += [Candidate("onnxruntime MatMulInteger, rows alone", _ort_matmul_integer, 1),
                  Candidate("onnxruntime MatMulNBits int4 (block 32, int8 activations)",
                            _ort_int4, 0.5 + 4 / 32)]
    except ImportError as error:
        skipped["onnxruntime"] = f"not installed ({error.name}): pip install -e '.[kernels]'"
    return found, skipped


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--copies", type=int, default=4,
                        help="distinct layers timed in turn (their weights outgrow the caches)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", nargs="+", default=None, help="candidate names to run")
    parser.add_argument("--out", default="bench_results/cpu_kernels.json")


def layer_weights(copies: int, generator: torch.Generator) -> list[list[torch.Tensor]]:
    h, i = SHAPES["hidden"], SHAPES["intermediate"]
    shapes = [(SHAPES["qkv"], h), (h, h), (2 * i, h), (h, i)]
    return [[torch.randn(shape, generator=generator) * 0.02 for shape in shapes]
            for _ in range(copies)]


def invariant(apply: Apply, x: torch.Tensor) -> bool:
    """Is every row's result bit-equal to the same row computed alone?"""
    together = apply(x)
    return all(torch.equal(together[r], apply(x[r:r + 1])[0]) for r in range(x.shape[0]))


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    weights = layer_weights(args.copies, generator)
    head = torch.randn(SHAPES["vocab"], SHAPES["hidden"], generator=generator) * 0.02
    inputs = {m: {width: torch.randn(m, width, generator=generator)
                  for width in (SHAPES["hidden"], SHAPES["intermediate"])}
              for m in args.rows}
    found, skipped = candidates()
    if args.only:
        found = [c for c in found if c.name in args.only]
    built: dict[str, tuple[list[list[Apply]], Apply]] = {}
    checks: dict[str, dict[str, Any]] = {}
    probe = torch.randn(16, SHAPES["hidden"], generator=generator)
    exact = torch.nn.functional.linear(probe.double(), weights[0][0].double())
    for candidate in found:
        started = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            layers = [[candidate.build(w) for w in layer] for layer in weights]
            out = candidate.build(head)
        seconds = time.perf_counter() - started
        y = layers[0][0](probe).double()
        checks[candidate.name] = {
            "rows_invariant": invariant(layers[0][0], probe)
            and invariant(layers[0][3], inputs[max(args.rows)][SHAPES["intermediate"]]),
            "relative_error": float((y - exact).norm() / exact.norm()),
            "prepare_s": seconds}
        built[candidate.name] = (layers, out)
        print(f"{candidate.name}: prepared in {seconds:.1f} s, rows invariant "
              f"{checks[candidate.name]['rows_invariant']}", flush=True)
    names = list(built)
    for layers, out in built.values():  # every shape once: first calls pack and allocate
        for m in args.rows:
            x_h, x_i = inputs[m][SHAPES["hidden"]], inputs[m][SHAPES["intermediate"]]
            for qkv, o, gate_up, down in layers:
                qkv(x_h), o(x_h), gate_up(x_h), down(x_i)
            out(x_h)
    times: dict[tuple[str, str, int], list[float]] = {}
    for round_no in range(args.rounds):
        order = names[round_no % len(names):] + names[:round_no % len(names)]
        for m in args.rows:
            x_h, x_i = inputs[m][SHAPES["hidden"]], inputs[m][SHAPES["intermediate"]]
            for name in order:
                layers, out = built[name]
                started = time.perf_counter()
                for qkv, o, gate_up, down in layers:
                    qkv(x_h)
                    o(x_h)
                    gate_up(x_h)
                    down(x_i)
                middle = time.perf_counter()
                out(x_h)
                ended = time.perf_counter()
                times.setdefault((name, "layer", m), []).append(
                    (middle - started) * 1000 / len(layers))
                times.setdefault((name, "head", m), []).append((ended - middle) * 1000)
        print(f"round {round_no}: done", flush=True)
    rows = []
    for name in names:
        step = None
        for m in args.rows:
            layer_ms = statistics.median(times[(name, "layer", m)])
            head_ms = statistics.median(times[(name, "head", m)])
            forward = SHAPES["layers"] * layer_ms + head_ms
            step = forward if step is None else step
            rows.append({"kernel": name, "rows": m, "layer_ms": layer_ms, "head_ms": head_ms,
                         "forward_ms": forward, "steps": forward / step,
                         "ms_per_row": forward / m, **checks[name]})
    table = markdown_table(rows, [
        ("kernel", "kernel"), ("rows", "rows"), ("forward_ms", "linears of a forward, ms"),
        ("steps", "in its 1-row forwards"), ("ms_per_row", "ms a row"),
        ("rows_invariant", "rows bit-invariant"), ("relative_error", "error vs float64")])
    print(table)
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    payload = {"command": getattr(args, "command_line", "python -m scripts.bench cpu-kernels"),
               "args": {k: v for k, v in vars(args).items() if k != "command_line"},
               "cpus": os.cpu_count(), "cpu_flags": vector_flags(), "shapes": SHAPES,
               "skipped": skipped, "rows": rows, "table": table,
               "times_ms": {f"{n}|{part}|{m}": v for (n, part, m), v in times.items()}}
    write_json(args.out, payload)
    return payload


def vector_flags() -> list[str]:
    """The vector extensions that decide which int8 kernels run."""
    wanted = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8")
    return [f for f in wanted if f in cpu_flags()]
