"""The ctypes side of ``w4a8_layer`` (kernels/dispatch.cpp): a decoder layer in one call, the
same operations in the same order as :meth:`W4A8Decoder.forward_ops` (so the same bits; the
committed digest holds for both), without a Python round trip between them."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from shared.engines.w4a8.model import Layer, Matrix, Shape

_p, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32


class CMatrix(ctypes.Structure):
    _fields_ = [("type", _i32), ("unused", _i32), ("weight", _p), ("weight_bytes", _i64),
                ("packed", _p), ("packed_bytes", _i64), ("rows", _i64), ("cols", _i64),
                ("bias", _p)]


class CLayer(ctypes.Structure):
    _fields_ = [("attn_norm", _p), ("mlp_norm", _p),
                *[(name, CMatrix) for name in ("q", "k", "v", "out", "gate", "up", "down")]]


class CDims(ctypes.Structure):
    _fields_ = [("hidden", _i64), ("intermediate", _i64), ("num_slots", _i64),
                ("slot_tokens", _i64), ("heads", _i32), ("kv_heads", _i32), ("head_dim", _i32),
                ("interleaved", _i32), ("eps", ctypes.c_float), ("unused", _i32)]


class CScratch(ctypes.Structure):
    _fields_ = [("h", _p), ("qkv", _p), ("attended", _p), ("gate_up", _p), ("inner", _p),
                ("tmp", _p), ("act", _p), ("act_bytes", _i64)]


def c_matrix(m: Matrix) -> CMatrix:
    return CMatrix(m.type, 0, m.address, m.nbytes,
                   None if m.packed is None else m.packed.data_ptr(),
                   0 if m.packed is None else m.packed.numel(), m.rows, m.cols,
                   None if m.bias is None else m.bias.data_ptr())


def c_layer(layer: Layer) -> CLayer:
    return CLayer(layer.attn_norm.data_ptr(), layer.mlp_norm.data_ptr(),
                  *[c_matrix(getattr(layer, name))
                    for name in ("q", "k", "v", "out", "gate", "up", "down")])


def c_dims(s: Shape, num_slots: int, slot_tokens: int) -> CDims:
    return CDims(s.hidden, s.intermediate, num_slots, slot_tokens, s.heads, s.kv_heads,
                 s.head_dim, int(s.interleaved), s.eps, 0)


class Scratch:
    """The buffers a forward of ``n`` rows works in (kept while it runs)."""

    def __init__(self, lib: ctypes.CDLL, s: Shape, n: int) -> None:
        width = (s.heads + 2 * s.kv_heads) * s.head_dim
        self.tensors = [torch.empty(n, s.hidden), torch.empty(n, width),
                        torch.empty(n, s.heads * s.head_dim), torch.empty(n, 2 * s.intermediate),
                        torch.empty(n, s.intermediate), torch.empty(n, s.hidden)]
        widest = max(s.hidden, s.heads * s.head_dim, s.intermediate)
        self.act = torch.empty(n * lib.w4a8_act_bytes(widest), dtype=torch.uint8)
        self.c = CScratch(*[t.data_ptr() for t in self.tensors], self.act.data_ptr(),
                          self.act.numel())
