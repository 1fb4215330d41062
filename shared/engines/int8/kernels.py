"""Row-invariant int8 products on a CPU: a row's result does not depend on the rows beside it.

fbgemm's dynamic int8 linear (``torch.ops.quantized.linear_dynamic``) multiplies in integers,
which sum exactly in any order, so only its activation quantization ties rows together: one
scale and zero point for the whole input, from the input's min and max. A block of 8 rows
therefore quantizes each row differently from a one-token step, and greedy output drifts.

:class:`Int8Linear` takes that choice away from the batch. Two pad columns hold +1 and -1
(their weights are zero, so they add exactly nothing), and each row is scaled by its own
largest magnitude into [-reach, reach] inside them. Every input then has min -1 and max +1
whatever its rows, so fbgemm picks the same quantization for every batch, and the row is
scaled back afterwards. ``reach`` is the top of that grid, (qmax - zero point) x scale: the
zero point of [-1, 1] rounds to 128 (64 with 7 bits), so +1 itself would clip a step short,
and a row's largest value, an outlier channel's, is the one that must not. The scaling is
per row and the dequantization elementwise; a row's output is bit-equal at any row count
(``tests/test_int8_engine.py``, with the shared-range negative control).
"""

from __future__ import annotations

import warnings

import torch

from shared.machine_cache import cpu_flags

PAD = 16  # sentinel columns (+1, -1, then zeros): the inner dimension stays a multiple of 16
SENTINELS = torch.tensor([1.0, -1.0] + [0.0] * (PAD - 2))


def quantized_engine() -> str:
    """fbgemm through PyTorch's "x86" quantized engine (the one int8 path measured here)."""
    if "x86" in torch.backends.quantized.supported_engines:
        torch.backends.quantized.engine = "x86"
    elif "fbgemm" in torch.backends.quantized.supported_engines:
        torch.backends.quantized.engine = "fbgemm"
    else:
        raise RuntimeError("this PyTorch has no x86 / fbgemm quantized engine: the int8 "
                           f"engine needs one (has {torch.backends.quantized.supported_engines})")
    return str(torch.backends.quantized.engine)


def has_vnni() -> bool:
    """Whether this CPU multiplies u8 x s8 into 32-bit sums in one step (AVX-512 VNNI, AVX-VNNI
    or AMX), where fbgemm's kernels cannot saturate; AVX2 alone sums pairs in 16 bits first."""
    return bool(cpu_flags() & {"avx512_vnni", "avx_vnni", "amx_int8"})


def activation_bits() -> int:
    """The activations' width this machine's kernels run without saturating: 8 with VNNI
    (``tests/test_int8_engine.py`` checks the sums), 7 on AVX2 alone (``reduce_range``: a
    16-bit pair sum of 8-bit activations can overflow there; measured on AVX2, 7 bits gave the
    better greedy agreement at the same speed)."""
    return 8 if has_vnni() else 7


def grid_top(qmax: int) -> float:
    """The largest value the activation grid of [-1, 1] holds exactly (fbgemm's choice for
    min -1 and max +1: scale 2 / qmax, zero point qmax / 2 rounded half to even)."""
    scale = 2.0 / qmax
    return (qmax - round(qmax / 2)) * scale


OUTLIERS = 8  # --int8-outliers 8: what brought the int8 engine as close to bf16 as Q4_K_M


class Int8Linear:
    """``x @ weight.T + bias`` with ``weight`` in int8 (symmetric, a scale per output channel)
    and each row of ``x`` quantized alone, to :func:`activation_bits` unless ``reduce_range``
    says (True: 7 bits, False: 8).

    ``outliers``: each row's that many largest magnitudes are taken out before the row is
    quantized, so its scale is set by the next largest value rather than by the one or two
    outlier channels that dominate it (where 8-bit steps are coarse for everything else).
    What matters is per row, not fixed channels: in a fake-quantized run a calibrated fixed
    set of 32 channels did little, 8 per row cut the KL divergence from bf16 5x; on the
    engine it halved (``python -m scripts.bench quality``). The outliers are multiplied one of
    two ways (``outlier_path``):

    * ``"columns"``: in float32 with their int8 weight columns, kept a second time transposed
      (``[in, out]``, a column a contiguous row); the products summed in a fixed pairwise
      order, elementwise. For layers with few outputs, where the copy and the sums are small;
    * ``"rows"``: as a second row of their own, quantized alone like any row, in the same
      fbgemm call (2n rows). For the output head, whose 151,936 columns would make the
      first way slow; a one-token step reads the weights once either way.

    Both are per row and elementwise, so rows stay bit-invariant."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 reduce_range: bool | None = None, outliers: int = 0,
                 outlier_path: str = "columns") -> None:
        if outlier_path not in ("columns", "rows"):
            raise ValueError(f"outlier_path is 'columns' or 'rows', not {outlier_path!r}")
        out_features, in_features = weight.shape
        w = torch.cat([weight.float(), torch.zeros(out_features, PAD)], dim=1)
        scales = (weight.float().abs().amax(dim=1) / 127.0).clamp_min(1e-12)
        with warnings.catch_warnings():  # quantized tensors are deprecated, fbgemm is not
            warnings.simplefilter("ignore")
            qweight = torch.quantize_per_channel(
                w, scales.double(), torch.zeros(out_features, dtype=torch.long), 0, torch.qint8)
            self.packed = torch.ops.quantized.linear_prepack(qweight, None)
            # a power of two (the pairwise sum halves it), at most the row
            self.outliers = 1 << (min(outliers, in_features).bit_length() - 1) if outliers else 0
            self.outlier_path = outlier_path
            # [in, out] int8: the columns a row's outliers multiply, a contiguous row each
            self.columns = (qweight.int_repr()[:, :in_features].t().contiguous()
                            if self.outliers and outlier_path == "columns" else None)
        self.weight_scales = scales.float()
        self.bias = None if bias is None else bias.float().contiguous()
        self.in_features = in_features
        self.out_features = out_features
        self.reduce_range = activation_bits() == 7 if reduce_range is None else reduce_range
        self.reach = grid_top(127 if self.reduce_range else 255)
        self.nbytes = (out_features * (in_features + PAD) + 4 * out_features
                       + (self.columns.numel() if self.columns is not None else 0))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[n, in_features] float32 -> [n, out_features] float32, row by row invariant."""
        n = x.shape[0]
        if not self.outliers:
            y = self._quantized(x)
        else:
            where = x.abs().topk(self.outliers, dim=1).indices  # [n, outliers]
            picked = x.gather(1, where)
            rest = x.scatter(1, where, 0.0)
            if self.outlier_path == "rows":
                y = self._quantized(torch.cat([rest, torch.zeros_like(x).scatter_(
                    1, where, picked)]))
                y = y[:n].add_(y[n:])
            else:
                assert self.columns is not None
                terms = self.columns[where].float().mul_(picked[:, :, None])  # [n, s, out]
                while terms.shape[1] > 1:  # pairwise: the same order for every row
                    terms = terms[:, 0::2] + terms[:, 1::2]
                y = self._quantized(rest).add_(terms[:, 0].mul_(self.weight_scales))
        return y if self.bias is None else y + self.bias

    def _quantized(self, x: torch.Tensor) -> torch.Tensor:
        """The rows through fbgemm, each quantized alone."""
        scale = self.reach / x.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)  # [n, 1]
        padded = torch.empty(x.shape[0], self.in_features + PAD)
        torch.mul(x, scale, out=padded[:, :self.in_features])
        padded[:, self.in_features:] = SENTINELS
        return torch.ops.quantized.linear_dynamic(padded, self.packed, self.reduce_range) / scale


class SharedRangeLinear(Int8Linear):
    """The negative control: the same weights with fbgemm's own per-batch activation range
    (what ``torch.ao.quantization.quantize_dynamic`` does), so a row's quantization depends on
    the other rows in the batch."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 reduce_range: bool | None = None, outliers: int = 0,
                 outlier_path: str = "columns") -> None:
        super().__init__(weight, bias, reduce_range)  # the whole row quantized, as there

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        padded = torch.zeros(x.shape[0], self.in_features + PAD)
        padded[:, :self.in_features] = x
        y = torch.ops.quantized.linear_dynamic(padded, self.packed, self.reduce_range)
        return y if self.bias is None else y + self.bias


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row ([n, d]): products, a quotient and a square root, each rounded
    once in any lane (the same bits in vector lanes and scalar tails), and a sum along the
    row, which ATen splits across threads by rows, never inside one (``parallel_dim_reduction``
    splits a dimension that is not reduced), while a row is shorter than its grain of 32,768
    (``shape_of`` refuses wider models: a one-token step's sum would be split there)."""
    return x * torch.rsqrt((x * x).mean(dim=1, keepdim=True) + eps) * weight


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for each row of ``gate_up`` ([n, 2 w], gate first, overwritten): [n, w].

    SiLU runs one call per row, the very call a one-token step makes. ATen splits an
    elementwise op across threads by element count, not by row, and runs each thread's share
    in vector lanes with a scalar tail for what is left; SiLU's scalar path rounds otherwise
    than its lanes (4.5% of values here). From 3 threads on a share can end inside a row,
    whose last elements then take the scalar path where a one-token step's took the lanes:
    over [n, 8,960] at 3, 4 and 8 threads, rows of a block differed from one-token steps
    (``tests/test_int8_engine.py``). A call of one row's shape splits and vectorizes the same
    way at any row count. The product is one rounding in any lane, so it runs whole."""
    width = gate_up.shape[1] // 2
    gate, up = gate_up[:, :width], gate_up[:, width:]
    for row in gate:
        torch.nn.functional.silu(row, inplace=True)
    return gate * up
