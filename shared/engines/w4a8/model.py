"""A Qwen2 / Llama decoder on a GGUF file's own Q4_K / Q6_K weights, every row computed as a
one-token step computes it.

The weights are the file's bytes, mapped (nothing is converted or copied: a start reads the
header and maps the rest). Each linear layer is ``w4a8_matmul`` (``kernels.cpp``): the
activations quantized per row in blocks of 256, integer sums inside a block, float sums across
blocks in one order whatever the row count. RMSNorm, the SiLU gate, rotary embeddings and
attention run in the same library, each row alone; the residual adds are elementwise. A block
of k + 1 rows, another session's rows beside it, a prompt decoded whole, at any thread count:
every row's logits are bit-equal to the one-token step's (``tests/test_w4a8_engine.py``).

Keys and values are float16 (as llama.cpp keeps them), one tensor per kind,
``[layers, slots, kv_heads, tokens, head_dim]``.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shared.engines.int8.model import Rows
from shared.engines.target import EngineLost
from shared.engines.w4a8.build import library, packing
from shared.engines.w4a8.fused import Scratch, c_dims, c_layer
from shared.engines.w4a8.gguf_file import MappedGGUF, TensorInfo
from shared.models.catalog import ModelSpecError

F32, F16, Q4_K, Q6_K = 0, 1, 12, 14
QUANTIZED = {Q4_K: "Q4_K", Q6_K: "Q6_K"}
# GGUF architecture -> whether its q / k rows rotate adjacent pairs (llama.cpp's converter
# reorders Llama's rows so) or the halves of a head (Qwen2 keeps transformers' layout)
ARCHITECTURES = {"qwen2": False, "llama": True}


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    eps: float
    rope_theta: float
    limit: int  # the file's context length
    interleaved: bool  # rotary pairs (2i, 2i + 1) rather than (i, i + head_dim / 2)


@dataclass(frozen=True)
class Matrix:
    """A quantized [rows, cols] GGUF tensor: its raw bytes, mapped from the file."""

    name: str
    type: int
    data: np.ndarray  # [rows, bytes a row] uint8
    rows: int
    cols: int
    bias: torch.Tensor | None = None  # [rows] float32
    packed: torch.Tensor | None = None  # the same in kernels/packed.h's panels (uint8)

    @property
    def address(self) -> int:
        return int(self.data.ctypes.data)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def packed(lib: Any, matrix: Matrix) -> Matrix:
    """``matrix`` with its panels for the paths that read them (``kernels/packed.h``)."""
    size = lib.w4a8_packed_bytes(matrix.type, matrix.rows, matrix.cols)
    out = torch.empty(size, dtype=torch.uint8)
    _check(lib.w4a8_pack(matrix.type, matrix.address, matrix.nbytes, matrix.rows, matrix.cols,
                         _ptr(out), size), f"packing {matrix.name}")
    return replace(matrix, packed=out)


@dataclass
class Layer:
    attn_norm: torch.Tensor
    q: Matrix
    k: Matrix
    v: Matrix
    out: Matrix
    mlp_norm: torch.Tensor
    gate: Matrix
    up: Matrix
    down: Matrix


def _ptr(tensor: torch.Tensor) -> int:
    return int(tensor.data_ptr())


def _check(status: int, what: str) -> None:
    """The kernels answer a negative code for arguments that do not fit their buffers."""
    if status != 0:
        raise RuntimeError(f"the w4a8 kernels refused {what} "
                           f"({'bad arguments' if status == -1 else 'a buffer too small'})")


# where each block keeps its fp16 scales: Q4_K d and dmin first, Q6_K d last
SCALES = {Q4_K: (144, slice(0, 4)), Q6_K: (210, slice(208, 210))}


def _finite_scales(path: str, name: str, type: int, data: np.ndarray) -> None:
    """ModelSpecError naming the tensor where a block scale is NaN or infinite: every value
    of such a block is, and so is every row it reaches (a constant token). A scan of the
    scales is a small part of the load (one in 36 or 105 of the bytes)."""
    size, where = SCALES[type]
    scales = np.ascontiguousarray(data.reshape(-1, size)[:, where]).view(np.float16)
    bad = ~np.isfinite(scales)  # [blocks, scales a block]
    if bad.any():
        row = int(np.flatnonzero(bad.any(axis=1))[0]) // (data.shape[1] // size)
        raise ModelSpecError(f"{path}: {name} has {int(bad.sum())} block scales that are not "
                             f"finite (NaN or infinite; the first in row {row}): a damaged "
                             "file")


class GGUFFile:
    """The tensors and metadata of a GGUF file, mapped (``gguf_file.MappedGGUF``)."""

    def __init__(self, path: str | Path) -> None:
        self.mapped = MappedGGUF(path)
        self.path = str(path)
        self.tensors = self.mapped.tensors

    def field(self, key: str, default: Any = None) -> Any:
        return self.mapped.fields.get(key, default)

    def architecture(self) -> str:
        return str(self.field("general.architecture", "?"))

    def f32(self, name: str) -> torch.Tensor:
        tensor = self._tensor(name)
        if tensor.type != F32 or len(tensor.shape) != 1:
            raise ModelSpecError(f"{self.path}: {name} is {tensor.type_name} "
                                 f"{list(tensor.shape)}; the w4a8 engine reads norms and "
                                 "biases as F32 vectors")
        values = self.mapped.data(name).view(np.float32).copy()
        if not np.isfinite(values).all():
            raise ModelSpecError(f"{self.path}: {name} holds {int((~np.isfinite(values)).sum())}"
                                 " values that are not finite (NaN or infinite): a damaged file")
        return torch.from_numpy(values)

    def matrix(self, name: str, bias: str | None = None) -> Matrix:
        tensor = self._tensor(name)
        if len(tensor.shape) != 2:
            raise ModelSpecError(f"{self.path}: {name} is {list(tensor.shape)}, not a matrix")
        cols, rows = tensor.shape
        if tensor.type not in QUANTIZED or cols % 256:
            raise ModelSpecError(
                f"{self.path}: {name} is {tensor.type_name} [{rows}, {cols}]; the w4a8 engine "
                "multiplies Q4_K and Q6_K rows of a multiple of 256 (a Q4_K_M or Q4_K_S file "
                "of such a model): serve this file with --engine llama-cpp")
        data = self.mapped.data(name).reshape(rows, -1)
        _finite_scales(self.path, name, tensor.type, data)
        return Matrix(name, tensor.type, data, rows, cols,
                      self.f32(bias) if bias and bias in self.tensors else None)

    def _tensor(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise ModelSpecError(f"{self.path} has no tensor {name!r}: not a model the w4a8 "
                                 "engine computes (serve it with --engine llama-cpp)")
        return self.tensors[name]


def _count(file: GGUFFile, key: str, default: int | None = None, low: int = 1,
           high: int = 1 << 20) -> int:
    """An integer field in [low, high], or ModelSpecError naming it."""
    value = file.field(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ModelSpecError(f"{file.path}: {key} = {value!r}, not a count in [{low}, {high}]")
    return value


def _positive(file: GGUFFile, key: str, default: float | None = None) -> float:
    value = file.field(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or value <= 0:
        raise ModelSpecError(f"{file.path}: {key} = {value!r}, not a positive number")
    return float(value)


def shape_of(file: GGUFFile) -> Shape:
    """The decoder's shape, or ModelSpecError for what this engine does not compute (every
    field a count in range, the heads dividing the width)."""
    arch = file.architecture()
    if arch not in ARCHITECTURES:
        raise ModelSpecError(f"{file.path} is a {arch} model; the w4a8 engine computes "
                             f"{', '.join(ARCHITECTURES)} (serve it with --engine llama-cpp)")
    if file.field(f"{arch}.rope.scaling.type", "none") not in ("none", None):
        raise ModelSpecError(f"{file.path}: the w4a8 engine has plain rotary embeddings only")
    heads = _count(file, f"{arch}.attention.head_count", high=4096)
    hidden = _count(file, f"{arch}.embedding_length")
    kv_heads = _count(file, f"{arch}.attention.head_count_kv", heads, high=heads)
    if heads % kv_heads:
        raise ModelSpecError(f"{file.path}: {arch}.attention.head_count_kv = {kv_heads} does not "
                             f"divide head_count = {heads}")
    if f"{arch}.attention.key_length" not in file.mapped.fields and hidden % heads:
        raise ModelSpecError(f"{file.path}: {arch}.attention.head_count = {heads} does not "
                             f"divide embedding_length = {hidden}")
    if heads // kv_heads > 64:
        raise ModelSpecError(f"{file.path}: {heads // kv_heads} query heads a key-value head "
                             f"({arch}.attention.head_count / head_count_kv); the w4a8 engine "
                             "attends with up to 64")
    head_dim = _count(file, f"{arch}.attention.key_length", hidden // heads, high=512)
    rope = _count(file, f"{arch}.rope.dimension_count", head_dim, high=4096)
    if rope != head_dim or head_dim % 8:
        raise ModelSpecError(f"{file.path}: {arch}.rope.dimension_count = {rope} for heads of "
                             f"{head_dim} ({arch}.embedding_length / head_count, or key_length)"
                             ": the w4a8 engine rotates whole heads of a multiple of 8 values")
    embed = file._tensor("token_embd.weight")
    if len(embed.shape) != 2:
        raise ModelSpecError(f"{file.path}: token_embd.weight is {embed.shape}, not a matrix")
    layers = _count(file, f"{arch}.block_count", high=4096)
    beyond = sorted(name for name in file.mapped.tensors if name.startswith("blk.")
                    and name.split(".")[1].isdigit() and int(name.split(".")[1]) >= layers)
    if beyond:  # llama.cpp refuses a file whose tensors it would not all use, and so do we
        raise ModelSpecError(f"{file.path}: tensor {beyond[0]} is past {arch}.block_count = "
                             f"{layers}")
    return Shape(layers=layers, hidden=hidden,
                 intermediate=_count(file, f"{arch}.feed_forward_length"), heads=heads,
                 kv_heads=kv_heads, head_dim=head_dim, vocab=int(embed.shape[1]),
                 eps=_positive(file, f"{arch}.attention.layer_norm_rms_epsilon"),
                 rope_theta=_positive(file, f"{arch}.rope.freq_base", 10000.0),
                 limit=_count(file, f"{arch}.context_length", 0, low=0, high=1 << 24),
                 interleaved=ARCHITECTURES[arch])


def _fits(file: GGUFFile, matrix: Matrix, rows: int, cols: int, why: str) -> Matrix:
    """``matrix`` if it is [rows, cols] (and its bias [rows]), else ModelSpecError naming it."""
    if (matrix.rows, matrix.cols) != (rows, cols):
        raise ModelSpecError(f"{file.path}: {matrix.name} is [{matrix.rows}, {matrix.cols}]; "
                             f"{why} make it [{rows}, {cols}]")
    if matrix.bias is not None and matrix.bias.numel() != rows:
        raise ModelSpecError(f"{file.path}: the bias of {matrix.name} holds "
                             f"{matrix.bias.numel()} values for {rows} rows")
    return matrix


def _norm(file: GGUFFile, name: str, width: int, why: str) -> torch.Tensor:
    weight = file.f32(name)
    if weight.numel() != width:
        raise ModelSpecError(f"{file.path}: {name} holds {weight.numel()} values; {why} make "
                             f"it {width}")
    return weight


def weights_of(file: GGUFFile, s: Shape) -> tuple[Matrix, list[Layer], torch.Tensor, Matrix]:
    """The embedding, the layers, the final norm and the output head, mapped from ``file``,
    every one checked against the shape (ModelSpecError naming the first tensor that does not
    fit, before any kernel reads a byte of it)."""
    arch = file.architecture()
    width = f"{arch}.embedding_length = {s.hidden}"
    q_rows, kv_rows = s.heads * s.head_dim, s.kv_heads * s.head_dim
    attn = f"{width} and {s.heads} heads ({s.kv_heads} for keys and values) of {s.head_dim}"
    ffn = f"{width} and {arch}.feed_forward_length = {s.intermediate}"
    embed = _fits(file, file.matrix("token_embd.weight"), s.vocab, s.hidden,
                  f"{width} and its vocabulary of {s.vocab}")
    layers = []
    for i in range(s.layers):
        def m(name: str, rows: int, cols: int, why: str, bias: bool = True,
              i: int = i) -> Matrix:
            full = f"blk.{i}.{name}.weight"
            return _fits(file, file.matrix(full, f"blk.{i}.{name}.bias" if bias else None),
                         rows, cols, why)

        layers.append(Layer(
            attn_norm=_norm(file, f"blk.{i}.attn_norm.weight", s.hidden, width),
            q=m("attn_q", q_rows, s.hidden, attn), k=m("attn_k", kv_rows, s.hidden, attn),
            v=m("attn_v", kv_rows, s.hidden, attn), out=m("attn_output", s.hidden, q_rows, attn),
            mlp_norm=_norm(file, f"blk.{i}.ffn_norm.weight", s.hidden, width),
            gate=m("ffn_gate", s.intermediate, s.hidden, ffn, bias=False),
            up=m("ffn_up", s.intermediate, s.hidden, ffn, bias=False),
            down=m("ffn_down", s.hidden, s.intermediate, ffn, bias=False)))
    norm = _norm(file, "output_norm.weight", s.hidden, width)
    # tied embeddings: the file keeps no output matrix, the head is the embedding's
    head = _fits(file, file.matrix("output.weight"), s.vocab, s.hidden,
                 f"{width} and the embedding's vocabulary of {s.vocab}") \
        if "output.weight" in file.tensors else embed
    return embed, layers, norm, head


class W4A8Decoder:
    """The mapped weights and the KV tensors; ``forward`` runs one batch of rows."""

    def __init__(self, file: GGUFFile, num_slots: int, slot_tokens: int) -> None:
        self.file = file  # keeps the mapping alive
        self.lib = library()
        s = self.shape = shape_of(file)
        self.embed, self.layers, self.norm, self.head = weights_of(file, s)
        if packing():  # a path this CPU runs reads panels: every product's matrix, packed once
            for layer in self.layers:
                for f in fields(layer):
                    value = getattr(layer, f.name)
                    if isinstance(value, Matrix):
                        setattr(layer, f.name, packed(self.lib, value))
            self.head = packed(self.lib, self.head)
        self.c_layers = [c_layer(layer) for layer in self.layers]  # pointers into the above
        self.slot_tokens = slot_tokens
        kv = (s.layers, num_slots, s.kv_heads, slot_tokens, s.head_dim)
        self.keys = torch.empty(kv, dtype=torch.float16)  # a row reads only what was written
        self.values = torch.empty(kv, dtype=torch.float16)
        # rotary angles, one row per position, computed once (float64, then float32)
        inv = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.float64)
                                      / s.head_dim))
        angles = torch.outer(torch.arange(slot_tokens, dtype=torch.float64), inv)
        self.cos = angles.cos().float().contiguous()  # [tokens, head_dim / 2]
        self.sin = angles.sin().float().contiguous()
        self.c_dims = c_dims(s, num_slots, slot_tokens)

    @property
    def nbytes(self) -> int:
        """Bytes of the KV tensors."""
        return 2 * self.keys.numel() * 2

    @property
    def weight_bytes(self) -> int:
        matrices = {id(m): m for m in [self.embed, self.head] + [
            x for layer in self.layers for x in (layer.q, layer.k, layer.v, layer.out,
                                                 layer.gate, layer.up, layer.down)]}
        return sum(m.nbytes for m in matrices.values())

    @property
    def packed_bytes(self) -> int:
        """Bytes of the packed copies (0 where no path reads them)."""
        matrices = [self.head] + [x for layer in self.layers for x in vars(layer).values()
                                  if isinstance(x, Matrix)]
        return sum(int(m.packed.numel()) for m in matrices if m.packed is not None)

    # -- the kernels, on tensors
    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """[n, k] float32 -> its activation blocks (uint8 bytes)."""
        n, k = x.shape
        out = torch.empty(n * self.lib.w4a8_act_bytes(k), dtype=torch.uint8)
        _check(self.lib.w4a8_quantize(_ptr(x), n, k, _ptr(out), out.numel()), "quantize")
        return out

    def matmul(self, matrix: Matrix, act: torch.Tensor, n: int, out: torch.Tensor,
               column: int = 0) -> None:
        """``out[:, column:column + rows] = activations @ matrix.T + bias``."""
        bias = 0 if matrix.bias is None else _ptr(matrix.bias)
        pack = matrix.packed
        _check(self.lib.w4a8_matmul(matrix.type, matrix.address, matrix.nbytes,
                                    None if pack is None else _ptr(pack),
                                    0 if pack is None else pack.numel(), matrix.rows,
                                    matrix.cols, _ptr(act), act.numel(), n, bias or None,
                                    _ptr(out) + 4 * column, out.numel() - column,
                                    out.shape[1]), f"matmul {matrix.name}")

    def linear(self, x: torch.Tensor, *matrices: Matrix) -> torch.Tensor:
        """``x`` through the matrices side by side (one quantization of ``x``)."""
        n = x.shape[0]
        act = self.quantize(x)
        out = torch.empty(n, sum(m.rows for m in matrices))
        column = 0
        for m in matrices:
            self.matmul(m, act, n, out, column)
            column += m.rows
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        _check(self.lib.w4a8_rms_norm(_ptr(x), _ptr(weight), self.shape.eps, x.shape[0],
                                      x.shape[1], _ptr(out)), "rms_norm")
        return out

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(len(ids), self.shape.hidden)
        _check(self.lib.w4a8_dequantize_rows(self.embed.type, self.embed.address,
                                             self.embed.nbytes, self.embed.rows,
                                             self.embed.cols, _ptr(ids), len(ids), _ptr(out)),
               "the embedding")
        return out

    def _inputs(self, rows: Rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows' slots, positions ([n] int64) and embeddings ([n, hidden]); EngineLost
        where the mapped file changed (before anything reads it)."""
        changed = self.file.mapped.changed()
        if changed is not None:
            raise EngineLost(f"the w4a8 engine stops: {changed}")
        if int(rows.ids.min()) < 0 or int(rows.ids.max()) >= self.shape.vocab:
            raise ValueError(f"token ids must be in [0, {self.shape.vocab})")
        return (torch.tensor(rows.slots, dtype=torch.int64),
                torch.tensor(rows.positions, dtype=torch.int64), self.embed_rows(rows.ids))

    def _logits(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """The output head's logits of rows ``keep`` of ``x``."""
        return self.linear(self.rms_norm(x[keep].contiguous(), self.norm), self.head)

    def forward(self, rows: Rows, keep: torch.Tensor) -> torch.Tensor:
        """Write the rows' keys and values, and return the logits of rows ``keep`` ([m])
        ([m, vocab] float32): each layer in one call of the kernels (``fused.py``), or, where a
        subclass changes one operation (the tests' negative controls), operation by operation
        (:meth:`forward_ops`, the same operations in the same order)."""
        if type(self).quantize is not W4A8Decoder.quantize:
            return self.forward_ops(rows, keep)
        s, lib = self.shape, self.lib
        n = len(rows.slots)
        slots, positions, x = self._inputs(rows)
        scratch = Scratch(lib, s, n)
        for index, layer in enumerate(self.c_layers):
            _check(lib.w4a8_layer(ctypes.addressof(layer), ctypes.addressof(self.c_dims),
                                  _ptr(x), n, _ptr(slots), _ptr(positions), _ptr(self.cos),
                                  _ptr(self.sin),
                                  _ptr(self.keys[index]), _ptr(self.values[index]),
                                  ctypes.addressof(scratch.c)), f"layer {index}")
        return self._logits(x, keep)

    def forward_ops(self, rows: Rows, keep: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` an operation at a time (each a call of the kernels)."""
        s, lib = self.shape, self.lib
        n = len(rows.slots)
        slots, positions, x = self._inputs(rows)
        attended = torch.empty(n, s.heads * s.head_dim)
        for index, layer in enumerate(self.layers):
            qkv = self.linear(self.rms_norm(x, layer.attn_norm), layer.q, layer.k, layer.v)
            _check(lib.w4a8_attention(_ptr(qkv), n, _ptr(slots), _ptr(positions), s.heads,
                                      s.kv_heads, s.head_dim, _ptr(self.cos), _ptr(self.sin),
                                      int(s.interleaved), _ptr(self.keys[index]),
                                      _ptr(self.values[index]), self.keys.shape[1],
                                      self.slot_tokens, _ptr(attended)), "attention")
            x += self.linear(attended, layer.out)
            gate_up = self.linear(self.rms_norm(x, layer.mlp_norm), layer.gate, layer.up)
            act = torch.empty(n, s.intermediate)
            _check(lib.w4a8_silu_mul(_ptr(gate_up), n, s.intermediate, _ptr(act)), "silu")
            x += self.linear(act, layer.down)
        return self._logits(x, keep)
