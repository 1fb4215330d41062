"""A long prompt is written in pieces of ``prefill_chunk`` tokens, one forward each, so a
forward's memory is bounded whatever the prompt's length (#57 finding 9: a 16k-token prompt in
one forward took 3.5 GB more); on the exact engines the rows after it are bit-equal to the
prompt written whole."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shared.engines.target import ForwardItem, Step, written_ahead
from tests.support.tiny_gguf import save_quantized_gguf
from verifier_service.settings import Settings, load_engine

PROMPT = [int(t) for t in np.random.default_rng(5).integers(2, 256, 900)]


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_quantized_gguf(tmp_path_factory.mktemp("chunks") / "target", seed=0)


def test_pieces_are_cut_at_multiples_of_the_chunk() -> None:
    pieces, rest = written_ahead(ForwardItem(3, 100, list(range(5000)), True, keep_from=4999),
                                 2048)
    assert [(p.start, len(p.token_ids)) for p in pieces] == [(100, 1948), (2048, 2048)]
    assert (rest.start, len(rest.token_ids), rest.keep_from) == (4096, 1004, 1003)
    assert written_ahead(ForwardItem(3, 0, list(range(100)), False), 2048)[0] == []


def last_row(engine: Any, chunk: int) -> tuple[torch.Tensor, list[int]]:
    """The prompt (less its last token) as a session's prefill, then its last token's row."""
    engine.prefill_chunk = chunk
    sizes: list[int] = []
    forward = engine.forward

    def recording(items: list[ForwardItem]) -> Any:
        sizes.append(sum(len(item.token_ids) for item in items))
        return forward(items)

    engine.forward = recording
    slot = engine.allocate()
    [result] = engine.run([Step(  # no block: the rows come back whole
        ForwardItem(slot, len(PROMPT) - 1, PROMPT[-1:], keep_logits=True), None,
        ForwardItem(slot, 0, PROMPT[:-1], keep_logits=False))])
    engine.forward = forward
    engine.release(slot)
    assert result.rows is not None
    return result.rows, sizes


@pytest.mark.parametrize("engine_name", ["w4a8", "llama-cpp"])
def test_a_long_prompt_in_pieces_leaves_the_same_rows(gguf: Path, engine_name: str) -> None:
    engine = load_engine(Settings(model=str(gguf), engine=engine_name, threads=1,
                                  max_context=1024, max_draft_tokens=4))
    whole, sizes_whole = last_row(engine, 4096)
    pieces, sizes = last_row(engine, 512)
    assert max(sizes_whole) >= len(PROMPT) - 1  # the control: one forward took it all
    assert max(sizes) <= 512 and len(sizes) >= 2
    assert torch.equal(whole, pieces)
