"""A fixed forward of the w4a8 engine, whose bits every machine and every kernel path must
reproduce: a committed digest of the logits of 20 rows (a prompt written whole) on a GGUF file
whose bytes are themselves fixed (tests/support/fixed_gguf.py). Replicas on an AVX2 EPYC, a
Zen 4 and a Sapphire Rapids then serve the same greedy tokens, and a session moved between them
(reopened) continues exactly."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from shared.engines.int8.model import Rows
from shared.engines.w4a8.build import choose_isa, paths
from shared.engines.w4a8.model import GGUFFile, W4A8Decoder
from tests.support.fixed_gguf import write_fixed_gguf
from tests.test_w4a8_engine import SIMD_PATHS, SharedScaleDecoder, on_path

FILE_SHA256 = "067041ac2a208ea8542563b48f3dc2ba0c9641bd63655873df21fed78b321259"
LOGITS_SHA256 = "a24910f76fae2af2fcc075dd9f53a415d40ff6bcb5ff7079ee6a1e7cbe895573"


@pytest.fixture(scope="module")
def fixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_fixed_gguf(tmp_path_factory.mktemp("fixed") / "fixed-q4_k_m.gguf")
    assert hashlib.sha256(path.read_bytes()).hexdigest() == FILE_SHA256, \
        "the fixed file's bytes changed (gguf's writer?): the digest below says nothing"
    return path


@pytest.fixture
def restore() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    choose_isa(None)
    torch.set_num_threads(threads)


def digest(path: Path, kind: type[W4A8Decoder] = W4A8Decoder, ops: bool = False) -> str:
    decoder = kind(GGUFFile(path), num_slots=2, slot_tokens=64)
    ids = [(17 * i + 3) % 256 for i in range(20)]
    forward = decoder.forward_ops if ops else decoder.forward
    logits = forward(Rows(torch.tensor(ids), [0] * 20, list(range(20))), torch.arange(20))
    return hashlib.sha256(logits.numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("name", ["portable", *SIMD_PATHS])
@pytest.mark.parametrize("threads", [1, 3])
def test_every_path_reproduces_the_committed_digest(name: str, threads: int, fixed: Path,
                                                    restore: None) -> None:
    assert name in paths()
    on_path(name)
    torch.set_num_threads(threads)
    assert digest(fixed) == LOGITS_SHA256


def test_a_layer_in_one_call_equals_it_operation_by_operation(fixed: Path) -> None:
    """w4a8_layer (one call a layer) and forward_ops (a call an operation, what the negative
    controls change) compute the same bits."""
    assert digest(fixed, ops=True) == digest(fixed) == LOGITS_SHA256


def test_negative_control_a_shared_activation_scale_changes_the_digest(fixed: Path) -> None:
    assert digest(fixed, SharedScaleDecoder) != LOGITS_SHA256
