"""Tiny GGUF files for the llama.cpp engine's tests, written offline from the tiny transformers
Llama models (``tiny_models.py``) with the ``gguf`` package: float32 tensors, llama.cpp's names
and its rotary layout, and the word-level vocabulary as a SentencePiece-style token list.

The transformers tokenizer is saved beside the file (``load_tokenizer`` prefers it to the
GGUF's own vocabulary), so client and verifier agree on the ids exactly.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch


def _rotary_interleave(weight: torch.Tensor, heads: int) -> np.ndarray:
    """transformers keeps each head's rotary pairs as (first half, second half); llama.cpp's
    llama architecture rotates adjacent pairs: reorder the rows of a q or k projection."""
    rows, cols = weight.shape
    return (weight.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2)
            .reshape(rows, cols).numpy())


def write_llama_gguf(model_dir: Path, path: Path) -> Path:
    """The transformers Llama checkpoint in ``model_dir`` as a float32 GGUF at ``path``."""
    import gguf
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(model_dir.name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(getattr(config, "rope_theta", None)
                                    or config.rope_parameters["rope_theta"]))
    writer.add_rope_dimension_count(config.hidden_size // heads)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    writer.add_tokenizer_model("llama")
    writer.add_token_list([name for name, _ in vocab])
    writer.add_token_scores([0.0] * len(vocab))
    types = [gguf.TokenType.NORMAL] * len(vocab)
    types[tokenizer.unk_token_id] = gguf.TokenType.UNKNOWN
    types[tokenizer.eos_token_id] = gguf.TokenType.CONTROL
    writer.add_token_types(types)
    writer.add_unk_token_id(tokenizer.unk_token_id)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_add_bos_token(False)

    state = {name: tensor.detach().float() for name, tensor in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"].numpy())
    for i in range(config.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"blk.{i}."
        writer.add_tensor(dst + "attn_norm.weight", state[src + "input_layernorm.weight"].numpy())
        writer.add_tensor(dst + "attn_q.weight",
                          _rotary_interleave(state[src + "self_attn.q_proj.weight"], heads))
        writer.add_tensor(dst + "attn_k.weight",
                          _rotary_interleave(state[src + "self_attn.k_proj.weight"], kv_heads))
        writer.add_tensor(dst + "attn_v.weight", state[src + "self_attn.v_proj.weight"].numpy())
        writer.add_tensor(dst + "attn_output.weight",
                          state[src + "self_attn.o_proj.weight"].numpy())
        writer.add_tensor(dst + "ffn_norm.weight",
                          state[src + "post_attention_layernorm.weight"].numpy())
        writer.add_tensor(dst + "ffn_gate.weight", state[src + "mlp.gate_proj.weight"].numpy())
        writer.add_tensor(dst + "ffn_up.weight", state[src + "mlp.up_proj.weight"].numpy())
        writer.add_tensor(dst + "ffn_down.weight", state[src + "mlp.down_proj.weight"].numpy())
    writer.add_tensor("output_norm.weight", state["model.norm.weight"].numpy())
    writer.add_tensor("output.weight", state["lm_head.weight"].numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def save_tiny_gguf(model_dir: Path) -> Path:
    """``model_dir/model.gguf`` beside the checkpoint and its tokenizer."""
    return write_llama_gguf(model_dir, model_dir / "model.gguf")


def llama_greedy(path: Path | str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """llama.cpp's own greedy decoding of the file: the prompt in one decode, then one token
    per decode on one sequence - what greedy speculation on the llama.cpp engine must equal."""
    from shared.engines.llama_cpp.runtime import LlamaModel, Segment

    model = LlamaModel(str(path), n_seqs=1, seq_tokens=len(prompt_ids) + max_new_tokens + 1,
                       threads=1)
    try:
        [rows] = model.decode([Segment(0, 0, prompt_ids, len(prompt_ids) - 1)])
        out: list[int] = []
        while True:
            assert rows is not None
            out.append(int(rows[-1].argmax()))
            if len(out) == max_new_tokens:
                return out
            [rows] = model.decode([Segment(0, len(prompt_ids) + len(out) - 1, out[-1:], 0)])
    finally:
        model.close()


def save_quantized_gguf(folder: Path, seed: int = 0, vocab_size: int = 256) -> Path:
    """``folder/model-q4_k_m.gguf``: a random Llama shaped to llama.cpp's quantization blocks
    (hidden 256, FFN 768, 2 layers, 4 query heads over 2 KV heads), written as float32 and
    quantized to Q4_K_M by llama.cpp itself, so its matrices run the kernels of a real Q4_K_M
    file: Q4_K and Q6_K rows of 256, enough rows to be repacked where that layout is on. Its
    logits are close to uniform, so a rounding difference shows as a different greedy token."""
    import llama_cpp
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.support.tiny_models import build_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    quantized = folder / "model-q4_k_m.gguf"
    if quantized.is_file():
        return quantized
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=256, intermediate_size=768,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, eos_token_id=1, bos_token_id=1,
                         initializer_range=0.05)
    LlamaForCausalLM(config).save_pretrained(folder)
    build_tokenizer(vocab_size).save_pretrained(folder)
    plain = write_llama_gguf(folder, folder / "model-f32.gguf")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = 1
    scratch = folder / "model-q4_k_m.gguf.part"
    if llama_cpp.llama_model_quantize(str(plain).encode(), str(scratch).encode(),
                                      ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {plain}")
    scratch.rename(quantized)
    plain.unlink()
    return quantized
