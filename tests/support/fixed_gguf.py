"""A tiny Q4_K_M-shaped Llama GGUF whose bytes are the same on every machine: its blocks are
drawn from numpy's PCG64 (a specified generator) and written raw with ``gguf``, nothing
quantized by float code that could round otherwise elsewhere. The w4a8 engine's committed
forward digest (tests/test_w4a8_digest.py) is computed on it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 512, 2, 4, 2, 256
BLOCK = {"Q4_K": 144, "Q6_K": 210}


def blocks(rng: np.random.Generator, kind: str, rows: int, cols: int) -> np.ndarray:
    """[rows, cols / 256 blocks] of random bytes with small positive float16 scales."""
    data = rng.integers(0, 256, (rows, cols // 256, BLOCK[kind]), dtype=np.uint8)
    scales = rng.uniform(0.002, 0.02, (rows, cols // 256, 2)).astype("<f2").view(np.uint8)
    if kind == "Q4_K":
        data[:, :, 0:4] = scales.reshape(rows, cols // 256, 4)
    else:
        data[:, :, 208:210] = scales.reshape(rows, cols // 256, 4)[:, :, :2]
    return data.reshape(rows, -1)


def write_fixed_gguf(path: Path, seed: int = 71, fields: dict[str, int] | None = None,
                     widths: dict[str, int] | None = None) -> Path:
    """The file; ``fields`` overrides metadata counts (``embedding_length``, ``head_count``,
    ...) and ``widths`` the rows of named tensors (a norm's values), each to build a file whose
    header does not fit its tensors."""
    import gguf

    f = {"embedding_length": HIDDEN, "feed_forward_length": FFN, "head_count": HEADS,
         "head_count_kv": KV_HEADS, **(fields or {})}
    rows_of = widths or {}
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(512)
    writer.add_embedding_length(f["embedding_length"])
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(f["feed_forward_length"])
    writer.add_head_count(f["head_count"])
    writer.add_head_count_kv(f["head_count_kv"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(HIDDEN // HEADS)

    def matrix(name: str, kind: str, rows: int, cols: int) -> None:
        writer.add_tensor(name, blocks(rng, kind, rows_of.get(name, rows), cols),
                          raw_dtype=getattr(gguf.GGMLQuantizationType, kind))

    def norm(name: str) -> None:
        width = rows_of.get(name, HIDDEN)
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(width)).astype(np.float32))

    matrix("token_embd.weight", "Q4_K", VOCAB, HIDDEN)
    kv = KV_HEADS * HIDDEN // HEADS
    for i in range(LAYERS):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", "Q4_K", HIDDEN, HIDDEN)
        matrix(f"blk.{i}.attn_k.weight", "Q4_K", kv, HIDDEN)
        matrix(f"blk.{i}.attn_v.weight", "Q6_K", kv, HIDDEN)
        matrix(f"blk.{i}.attn_output.weight", "Q4_K", HIDDEN, HIDDEN)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", "Q4_K", FFN, HIDDEN)
        matrix(f"blk.{i}.ffn_up.weight", "Q4_K", FFN, HIDDEN)
        matrix(f"blk.{i}.ffn_down.weight", "Q6_K", HIDDEN, FFN)
    norm("output_norm.weight")
    matrix("output.weight", "Q6_K", VOCAB, HIDDEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
