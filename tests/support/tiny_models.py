"""Tiny models built from a config (random weights, small vocab, an offline tokenizer), and the
target's own greedy output as the reference for exactness tests."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    BartConfig,
    BartForConditionalGeneration,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

from shared.models.catalog import load_causal_lm

WORDS = ["the", "cat", "dog", "sat", "on", "mat", "a", "ran", "to", "big", "red", "def",
         "return", "(", ")", ":", "x", "y", "+", "=", "1", "2", "if", "else"]


# Roles are not in the vocabulary (they encode as <unk>); enough to test the chat paths.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant : {% endif %}")


def build_tokenizer(vocab_size: int, extra: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """A word-level tokenizer with exactly ``vocab_size`` ids, built offline; ``extra``: more
    words (no whitespace in them) after ``WORDS``."""
    names = ["<unk>", "<eos>", *WORDS, *extra]
    names += [f"w{i}" for i in range(vocab_size - len(names))]
    vocab = {name: i for i, name in enumerate(names[:vocab_size])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>",
                                        eos_token="<eos>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_byte_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (GPT-2's byte-to-character mapping) whose ids are single bytes:
    ASCII letters and the lead bytes of two-byte UTF-8 characters (0xC3, ...), so a generation
    can end in the middle of a character, which then decodes to U+FFFD."""
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    leads = [chr(b) for b in range(0xC2, 0xD0)]  # bytes >= 0xA1 map to the same code point
    names = ["<unk>", "<eos>", "\u0120", *letters, *leads][:vocab_size]  # U+0120: a space
    names += [chr(b) for b in range(0xA1, 0xC0)][:vocab_size - len(names)]
    assert len(names) == vocab_size, len(names)
    return _byte_level(names)


def _byte_level(names: list[str]) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2's byte-to-character mapping) with no merges: one id
    per entry of ``names``, in order."""
    core = Tokenizer(models.BPE(vocab={name: i for i, name in enumerate(names)}, merges=[],
                                unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>",
                                        eos_token="<eos>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(arch: str, vocab_size: int, seed: int, init_range: float = 0.02):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    common = {"vocab_size": vocab_size, "eos_token_id": 1, "bos_token_id": 1}
    if arch == "gpt2":
        config = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=256,
                            initializer_range=init_range, **common)
        model = GPT2LMHeadModel(config)
    else:
        config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=256, initializer_range=init_range,
                             tie_word_embeddings=False, **common)
        model = LlamaForCausalLM(config)
    return model.eval()


def save_tiny(folder: Path, arch: str, vocab_size: int, seed: int,
              init_range: float = 0.02) -> Path:
    build_model(arch, vocab_size, seed, init_range).save_pretrained(folder)
    build_tokenizer(vocab_size).save_pretrained(folder)
    return folder


def build_ascii_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer of 97 ids: <unk>, <eos>, the space and printable ASCII, one byte
    each - enough for any JSON text (structured output's tests)."""
    # U+0120: a space
    return _byte_level(["<unk>", "<eos>", "\u0120", *(chr(c) for c in range(33, 127))])


def save_ascii(folder: Path, seed: int) -> Path:
    """A GPT-2 over ``build_ascii_tokenizer``'s 97 ids."""
    build_model("gpt2", 97, seed, init_range=0.3).save_pretrained(folder)
    build_ascii_tokenizer().save_pretrained(folder)
    return folder


def save_byte_level(folder: Path, seed: int) -> Path:
    """A vocab-64 GPT-2 with ``build_byte_tokenizer``'s byte-level vocabulary."""
    build_model("gpt2", 64, seed, init_range=0.3).save_pretrained(folder)
    build_byte_tokenizer(64).save_pretrained(folder)
    return folder


def save_parrot(folder: Path, word: str, vocab_size: int = 64) -> Path:
    """A GPT-2 whose greedy answer is ``word`` (one token of its word-level vocabulary) again
    and again, whatever the prompt: its final layer norm ignores the hidden state (weight 0)
    and outputs, as its bias, ``word``'s embedding, which is scaled up so that its logit (the
    embedding's square: the head is tied) beats every other token's."""
    tokenizer = build_tokenizer(vocab_size, extra=(word,))
    model = build_model("gpt2", vocab_size, seed=23)
    token = tokenizer.convert_tokens_to_ids(word)
    with torch.no_grad():
        model.transformer.wte.weight[token] *= 10.0
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.copy_(model.transformer.wte.weight[token])
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def build_seq2seq(arch: str, vocab_size: int, seed: int, init_std: float = 0.5):  # type: ignore[no-untyped-def]
    """A tiny encoder-decoder: T5-style (relative positions, decoder starts with pad = 0) or
    BART-style (learned positions, decoder starts with EOS = 1)."""
    torch.manual_seed(seed)
    if arch == "t5":
        config = T5Config(vocab_size=vocab_size, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                          num_decoder_layers=2, num_heads=4, pad_token_id=0, eos_token_id=1,
                          decoder_start_token_id=0, initializer_factor=init_std,
                          tie_word_embeddings=False)
        model = T5ForConditionalGeneration(config)
    else:
        config = BartConfig(vocab_size=vocab_size, d_model=32, encoder_layers=2,
                            decoder_layers=2, encoder_attention_heads=4,
                            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                            max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                            eos_token_id=1, decoder_start_token_id=1, forced_eos_token_id=None,
                            init_std=init_std, scale_embedding=False)
        model = BartForConditionalGeneration(config)
    return model.eval()


def save_seq2seq(folder: Path, arch: str, vocab_size: int, seed: int,
                 init_std: float = 0.5) -> Path:
    build_seq2seq(arch, vocab_size, seed, init_std).save_pretrained(folder)
    build_tokenizer(vocab_size).save_pretrained(folder)
    return folder


def save_tiny_qwen2(folder: Path, vocab_size: int = 256, seed: int = 29,
                    init_range: float = 0.1) -> Path:
    """A 3-layer Qwen2 (query / key / value biases, grouped-query attention, rotary
    embeddings) of 64 dimensions: the int8 engine's test target."""
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, initializer_range=init_range,
                         tie_word_embeddings=False, eos_token_id=1, bos_token_id=1)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # biases are zeros at initialisation: give them values to test
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, init_range)
    model.save_pretrained(folder)
    build_tokenizer(vocab_size).save_pretrained(folder)
    return folder


def save_perturbed(source: Path, folder: Path, noise: float, seed: int) -> Path:
    """A drafter correlated with its target: the target's weights plus Gaussian noise."""
    auto = (AutoModelForSeq2SeqLM if AutoConfig.from_pretrained(source).is_encoder_decoder
            else AutoModelForCausalLM)
    model = auto.from_pretrained(source, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(noise * torch.randn(param.shape, generator=generator))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)  # the target's own
    return folder



def build_tiny_set(root: Path) -> dict[str, Path]:
    """The fixture's model folders. 'gpt2-*' and 'llama-*': vocab 64 target/drafter pairs;
    'peaky-*': vocab 16 with peaked distributions, for the statistical tests; 't5-*',
    'bart-*' and 'peaky-t5-*': encoder-decoder pairs; 'json-*': printable ASCII, one byte a
    token (structured output)."""
    paths = {
        "gpt2-target": save_tiny(root / "gpt2-target", "gpt2", 64, seed=1, init_range=0.3),
        "llama-target": save_tiny(root / "llama-target", "llama", 64, seed=3, init_range=0.3),
        "peaky-target": save_tiny(root / "peaky-target", "llama", 16, seed=5, init_range=0.5),
        "other-vocab": save_tiny(root / "other-vocab", "gpt2", 48, seed=7),
        "json-target": save_ascii(root / "json-target", seed=23),
    }
    paths["t5-target"] = save_seq2seq(root / "t5-target", "t5", 64, seed=13, init_std=10.0)
    paths["bart-target"] = save_seq2seq(root / "bart-target", "bart", 64, seed=17, init_std=0.3)
    paths["peaky-t5-target"] = save_seq2seq(root / "peaky-t5-target", "t5", 16, seed=19,
                                            init_std=0.3)
    for name, noise in (("gpt2", 0.02), ("llama", 0.01), ("peaky", 0.02), ("t5", 0.02),
                        ("bart", 0.02), ("peaky-t5", 0.3), ("json", 0.02)):
        paths[f"{name}-drafter"] = save_perturbed(paths[f"{name}-target"],
                                                  root / f"{name}-drafter", noise, seed=11)
    return paths


def hf_greedy(model_dir: Path | str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The target's own ``generate(do_sample=False)``: what greedy speculation must equal."""
    model = load_causal_lm(str(model_dir), torch.float32, torch.device("cpu"))
    out = model.generate(torch.tensor([prompt_ids]), do_sample=False,
                         max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    return list(out[0, len(prompt_ids):].tolist())
