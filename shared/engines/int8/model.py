"""A Llama / Qwen2-family decoder whose every row is computed as a one-token step computes it.

The linear layers are :class:`~shared.engines.int8.kernels.Int8Linear` (int8 weights, rows
quantized alone, integer sums); RMSNorm, rotary embeddings and the MLP's gate are row-wise
elementwise work; attention runs row by row, each row over exactly its own prefix of the
cache (``[kv_heads, group, d] @ [kv_heads, d, position + 1]``), so its shapes, and with them
the kernels torch picks, are those of a one-token step at that position whatever else the
forward holds. A block of k + 1 rows, another session's rows beside it, or a prompt decoded
whole: every row's logits are bit-equal to the one-token step's.

Keys and values are float32 in one tensor per kind, ``[layers, slots, kv_heads, tokens, d]``.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shared.engines.int8.kernels import Int8Linear, rms_norm, silu_mul
from shared.models.catalog import ModelSpecError

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    eps: float
    rope_theta: float
    limit: int  # max_position_embeddings


def shape_of(config: Any) -> Shape:
    """The decoder's shape, or ModelSpecError for what this engine does not compute."""
    arch = (getattr(config, "architectures", None) or ["?"])[0]
    if arch not in ARCHITECTURES:
        raise ModelSpecError(f"the int8 engine runs {', '.join(ARCHITECTURES)}; got {arch}")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ModelSpecError(f"the int8 engine has default rotary embeddings only; {arch} "
                             f"asks for {rope.get('rope_type') or rope.get('type')}")
    if getattr(config, "use_sliding_window", False) or getattr(config, "sliding_window", None) \
            and arch == "MistralForCausalLM":
        raise ModelSpecError("the int8 engine has no sliding-window attention")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ModelSpecError(f"the int8 engine computes SiLU MLPs; got {config.hidden_act}")
    for flag in ("mlp_bias", "use_qk_norm"):  # weights this engine would leave out
        if getattr(config, flag, False):
            raise ModelSpecError(f"the int8 engine has no {flag}; {arch}'s config sets it")
    if int(config.hidden_size) >= 32768:  # ATen's grain: a lone row's sum would be split
        raise ModelSpecError(f"the int8 engine's RMSNorm sums a row in one thread, up to "
                             f"32,767 values; hidden size {config.hidden_size}")
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    return Shape(layers=int(config.num_hidden_layers), hidden=int(config.hidden_size),
                 heads=heads, kv_heads=int(getattr(config, "num_key_value_heads", heads)),
                 head_dim=head_dim, vocab=int(config.vocab_size), eps=float(config.rms_norm_eps),
                 rope_theta=theta, limit=int(getattr(config, "max_position_embeddings", 0) or 0))


# Every tensor this engine reads; a checkpoint with any other (a Qwen3's query/key norms under a
# Qwen2 label, MLP biases) computes something the engine would not, and is refused.
COMPUTED = re.compile(
    r"(model\.)?(embed_tokens\.weight|norm\.weight|layers\.\d+\.("
    r"(input_layernorm|post_attention_layernorm)\.weight|self_attn\.[qkv]_proj\.(weight|bias)"
    r"|self_attn\.o_proj\.(weight|bias)|mlp\.(gate|up|down)_proj\.weight))"
    r"|lm_head\.(weight|bias)")


def refuse_unread(names: Iterable[str], source: str) -> None:
    """ModelSpecError naming the tensors of ``names`` this engine would not read."""
    unread = sorted(name for name in names if not COMPUTED.fullmatch(name))
    if unread:
        shown = ", ".join(unread[:4]) + (f" and {len(unread) - 4} more" if len(unread) > 4
                                         else "")
        raise ModelSpecError(f"the int8 engine would leave out {len(unread)} tensors of "
                             f"{source}, so it would compute another model: {shown}")


def checkpoint_tensor_names(folder: str) -> list[str]:
    """The names of the tensors in ``folder``'s safetensors files (none for a checkpoint in
    another format: then what the loaded model holds is all that is checked)."""
    from safetensors import safe_open

    names: list[str] = []
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as tensors:
            names += tensors.keys()
    return names


@dataclass
class Layer:
    attn_norm: torch.Tensor
    qkv: Int8Linear
    out: Int8Linear
    mlp_norm: torch.Tensor
    gate_up: Int8Linear
    down: Int8Linear


@dataclass(frozen=True)
class Rows:
    """The new tokens of one forward, flattened: for each row its slot and position."""

    ids: torch.Tensor  # [n] long
    slots: list[int]
    positions: list[int]


class Int8Decoder:
    """The weights (int8 linears, float32 norms and embeddings) and the KV tensors."""

    def __init__(self, model: Any, num_slots: int, slot_tokens: int,
                 linear: type[Int8Linear] = Int8Linear, outliers: int = 0) -> None:
        s = self.shape = shape_of(model.config)
        refuse_unread(model.state_dict(), "the loaded model")
        # A row's outliers (Int8Linear) where they cost little and count: the attention's
        # projections and the MLP's down projection (few outputs: their int8 columns), the
        # output head (a second row). Not the gate/up projection: 17,920 outputs a layer, for
        # a KL divergence from bf16 of 0.0010 instead of 0.0014 in a fake-quantized run.
        few = functools.partial(linear, outliers=outliers)
        head = functools.partial(linear, outliers=outliers, outlier_path="rows")
        decoder = model.model
        # [vocab, hidden] as the checkpoint keeps it (bfloat16 rows widen to float32 exactly)
        self.embed = decoder.embed_tokens.weight.detach().clone()  # nothing of the checkpoint
        self.layers = []
        for block in decoder.layers:
            a, m = block.self_attn, block.mlp
            biases = [p.bias for p in (a.q_proj, a.k_proj, a.v_proj)]
            bias = None if all(b is None for b in biases) else torch.cat([
                b.detach().float() if b is not None else torch.zeros(p.weight.shape[0])
                for b, p in zip(biases, (a.q_proj, a.k_proj, a.v_proj), strict=True)])
            self.layers.append(Layer(
                attn_norm=block.input_layernorm.weight.detach().float().clone(),
                qkv=few(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
                        .detach(), bias),
                out=few(a.o_proj.weight.detach(), _bias(a.o_proj)),
                mlp_norm=block.post_attention_layernorm.weight.detach().float().clone(),
                gate_up=linear(torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach(), None),
                down=few(m.down_proj.weight.detach(), None)))
        self.norm = decoder.norm.weight.detach().float().clone()
        self.head = head(model.lm_head.weight.detach(), _bias(model.lm_head))
        self.slot_tokens = slot_tokens
        kv = (s.layers, num_slots, s.kv_heads, slot_tokens, s.head_dim)
        self.keys = torch.empty(kv)  # a row reads only the prefix written before it
        self.values = torch.empty(kv)
        # rotary angles, one row per position, computed once (float64, then float32)
        inv = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.float64)
                                      / s.head_dim))
        angles = torch.outer(torch.arange(slot_tokens, dtype=torch.float64), inv)
        angles = torch.cat([angles, angles], dim=1)
        self.cos, self.sin = angles.cos().float(), angles.sin().float()  # [tokens, head_dim]

    @property
    def nbytes(self) -> int:
        """Bytes of the KV tensors."""
        return 2 * self.keys.numel() * 4

    @property
    def weight_bytes(self) -> int:
        linears = [self.head] + [x for layer in self.layers
                                 for x in (layer.qkv, layer.out, layer.gate_up, layer.down)]
        return sum(x.nbytes for x in linears) + self.embed.numel() * self.embed.element_size()

    def forward(self, rows: Rows, keep: torch.Tensor) -> torch.Tensor:
        """Write the rows' keys and values, and return the logits of rows ``keep`` ([m])
        ([m, vocab] float32)."""
        s = self.shape
        n, q_width, kv_width = len(rows.slots), s.heads * s.head_dim, s.kv_heads * s.head_dim
        where, slot_index = torch.tensor(rows.positions), torch.tensor(rows.slots)
        cos, sin = self.cos[where][:, None, :], self.sin[where][:, None, :]  # [n, 1, d]
        x = self.embed[rows.ids].float()  # [n, hidden]
        for index, layer in enumerate(self.layers):
            qkv = layer.qkv(rms_norm(x, layer.attn_norm, s.eps))  # [n, q + 2 kv]
            q = _rotate(qkv[:, :q_width].view(n, s.heads, s.head_dim), cos, sin)
            k = _rotate(qkv[:, q_width:q_width + kv_width].view(n, s.kv_heads, s.head_dim),
                        cos, sin)
            v = qkv[:, q_width + kv_width:].view(n, s.kv_heads, s.head_dim)
            keys, values = self.keys[index], self.values[index]
            keys[slot_index, :, where] = k  # [n, kv_heads, d] into each row's slot and position
            values[slot_index, :, where] = v
            x = x + layer.out(self._attend(q, keys, values, rows))
            h = layer.gate_up(rms_norm(x, layer.mlp_norm, s.eps))  # [n, 2 intermediate]
            x = x + layer.down(silu_mul(h))
        return self.head(rms_norm(x[keep], self.norm, s.eps))

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                rows: Rows) -> torch.Tensor:
        """Each row over its own cached prefix: [n, heads, d] -> [n, heads * d]."""
        s = self.shape
        queries = (q * (1.0 / math.sqrt(s.head_dim))).view(
            q.shape[0], s.kv_heads, s.heads // s.kv_heads, s.head_dim)  # [n, kv_heads, group, d]
        out = torch.empty(q.shape[0], s.kv_heads, s.heads // s.kv_heads, s.head_dim)
        for r, (slot, pos) in enumerate(zip(rows.slots, rows.positions, strict=True)):
            scores = torch.matmul(queries[r], keys[slot, :, :pos + 1].transpose(1, 2))
            torch.matmul(torch.softmax(scores, dim=-1), values[slot, :, :pos + 1], out=out[r])
        return out.view(q.shape[0], -1)


def _bias(linear: Any) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach().float().clone()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (the rotate-half layout of Llama and Qwen2): x [n, heads, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
