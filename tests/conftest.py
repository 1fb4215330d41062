"""Fixtures: tiny models built from a config (random weights, small vocab, offline tokenizer)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import uvicorn
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from verifier_service.app import create_app
from verifier_service.settings import Settings
from verifier_service.target import TargetRunner

WORDS = ["the", "cat", "dog", "sat", "on", "mat", "a", "ran", "to", "big", "red", "def",
         "return", "(", ")", ":", "x", "y", "+", "=", "1", "2", "if", "else"]


def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer with exactly ``vocab_size`` ids, built offline."""
    names = ["<unk>", "<eos>", *WORDS]
    names += [f"w{i}" for i in range(vocab_size - len(names))]
    vocab = {name: i for i, name in enumerate(names[:vocab_size])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<eos>")


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


def save_perturbed(source: Path, folder: Path, noise: float, seed: int) -> Path:
    """A drafter correlated with its target: the target's weights plus Gaussian noise."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(noise * torch.randn(param.shape, generator=generator))
    model.save_pretrained(folder)
    build_tokenizer(model.config.vocab_size).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Local checkpoint folders. 'gpt2-*' and 'llama-*': vocab 64 target/drafter pairs;
    'peaky-*': vocab 16 with peaked distributions, for the statistical tests."""
    root = tmp_path_factory.mktemp("models")
    paths = {
        "gpt2-target": save_tiny(root / "gpt2-target", "gpt2", 64, seed=1, init_range=0.3),
        "llama-target": save_tiny(root / "llama-target", "llama", 64, seed=3, init_range=0.3),
        "peaky-target": save_tiny(root / "peaky-target", "llama", 16, seed=5, init_range=0.5),
        "other-vocab": save_tiny(root / "other-vocab", "gpt2", 48, seed=7),
    }
    for name, noise in (("gpt2", 0.02), ("llama", 0.01), ("peaky", 0.02)):
        paths[f"{name}-drafter"] = save_perturbed(paths[f"{name}-target"],
                                                  root / f"{name}-drafter", noise, seed=11)
    return paths


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LiveServer:
    """A real uvicorn server on a loopback port, in a thread of the test process."""

    def __init__(self, settings: Settings, runner: TargetRunner | None = None) -> None:
        self.port = free_port()
        config = uvicorn.Config(create_app(settings, runner), host="127.0.0.1", port=self.port,
                                log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("verifier did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def fp32_settings(model: Path, **overrides: object) -> Settings:
    return Settings(model=str(model), dtype="float32", device="cpu", **overrides)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def gpt2_server(tiny_models: dict[str, Path]) -> Iterator[LiveServer]:
    with LiveServer(fp32_settings(tiny_models["gpt2-target"], max_draft_tokens=8)) as server:
        yield server


@pytest.fixture(scope="session")
def llama_server(tiny_models: dict[str, Path]) -> Iterator[LiveServer]:
    with LiveServer(fp32_settings(tiny_models["llama-target"], max_draft_tokens=8,
                                  max_context=64)) as server:
        yield server
