"""Exact greedy output on the llama.cpp engine, on a tiny Q4_K_M file whose matrices take the
kernels of a real one (``save_quantized_gguf``: Q4_K / Q6_K rows of 256, enough rows to be
repacked).

The exact kernels (``kernels="exact"``, the default) compute every row of a decode as a
one-token step computes it: a verify block's logits rows are bit-equal to one-token steps', for
any block length, after other sessions' history and beside other sessions in the same decode,
so greedy speculation equals the target alone's token for token. The negative controls run
llama.cpp's defaults (``kernels="fast"``: repacked weights, one unified cache), whose blocks
round differently, and must fail the same checks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from drafter_client import SpecDecClient
from drafter_client.api import DrafterOptions
from shared.engines.llama_cpp import runtime
from shared.engines.llama_cpp.runtime import GGUFWeights, LlamaModel, Segment, exact_kernels
from tests.support.greedy import speculative_vs_alone, target_alone
from tests.support.live_server import LiveServer
from verifier_service.settings import Settings, load_engine

NEW = 24  # new tokens per check


def context(path: Path, kernels: str) -> LlamaModel:
    """Six sequences of 256 tokens, as the engine lays them out for ``kernels``."""
    return LlamaModel(GGUFWeights(str(path), 1), n_seqs=6, seq_tokens=256, threads=1,
                      cells=6 * 256, exact=kernels == "exact")


PROMPT = [5, 17, 33, 2, 90, 41, 7, 250, 12, 64, 3, 128]
OTHER = [int(t) for t in np.random.default_rng(3).integers(2, 256, 37)]
CONTROL_PROMPTS = [[int(t) for t in np.random.default_rng(11).integers(2, 256, n)]
                   for n in (12, 16, 13)]


def one_token_steps(model: LlamaModel, seq: int) -> tuple[list[int], np.ndarray]:
    """Greedy decoding one token per decode: the tokens and every step's logits row."""
    [rows] = model.decode([Segment(seq, 0, PROMPT, len(PROMPT) - 1)])
    assert rows is not None
    kept, out = [rows[-1]], []
    for i in range(NEW):
        out.append(int(kept[-1].argmax()))
        [rows] = model.decode([Segment(seq, len(PROMPT) + i, out[-1:], 0)])
        assert rows is not None
        kept.append(rows[0])
    model.remove(seq)
    return out, np.stack(kept)


def in_blocks(model: LlamaModel, seq: int, tokens: list[int], k: int,
              beside: int | None = None) -> np.ndarray:
    """The same rows from the prompt less its last token (as a session writes it), then the
    last prompt token and ``tokens`` ``k`` at a time (verify blocks); ``beside``: another
    sequence writes 3 tokens in each of the same decodes."""
    model.decode([Segment(seq, 0, PROMPT[:-1])])
    [rows] = model.decode([Segment(seq, len(PROMPT) - 1, PROMPT[-1:], 0)])
    assert rows is not None
    kept = [rows[-1]]
    other_at = model.length(beside) if beside is not None else 0
    for at in range(0, NEW, k):
        segments = [Segment(seq, len(PROMPT) + at, tokens[at:at + k], 0)]
        if beside is not None:
            segments.append(Segment(beside, other_at, [3, 4, 5], 0))
            other_at += 3
        block = model.decode(segments)[0]
        assert block is not None
        kept.extend(block)
    model.remove(seq)
    return np.stack(kept[:NEW + 1])


def block_layouts(model: LlamaModel) -> dict[str, bool]:
    """Whether each way of writing the same tokens gives rows bit-equal to one-token steps."""
    tokens, reference = one_token_steps(model, 0)
    same = {f"k={k}": np.array_equal(in_blocks(model, 1, tokens, k), reference)
            for k in (2, 4, 8, 16)}
    model.decode([Segment(2, 0, OTHER, None)])  # another session's cells come first
    same["after another session"] = np.array_equal(in_blocks(model, 3, tokens, 8), reference)
    same["beside another session"] = np.array_equal(in_blocks(model, 4, tokens, 5, beside=2),
                                                    reference)
    return same


def test_exact_kernels_are_installed() -> None:
    """`make install` builds llama.cpp without llamafile and the runtime keeps its tiled
    kernel off: the exact configuration is what this machine runs."""
    assert exact_kernels() == (True, exact_kernels()[1]), exact_kernels()[1]


def test_block_rows_equal_one_token_steps(q4k: dict[str, Path]) -> None:
    assert block_layouts(context(q4k["target"], "exact")) == {
        "k=2": True, "k=4": True, "k=8": True, "k=16": True,
        "after another session": True, "beside another session": True}


def repacked(model: LlamaModel) -> LlamaModel:
    if not model.weights.extra_layouts:
        pytest.skip("llama.cpp offers no repacked layout on this CPU: its blocks of 4 rows "
                    "and more take the one-row kernels there")
    return model


def test_negative_control_fast_kernels_round_blocks_differently(q4k: dict[str, Path]) -> None:
    """kernels="fast": repacked Q4_K rows of four and more are multiplied in another order
    than one, so a block's rows are not a one-token step's."""
    same = block_layouts(repacked(context(q4k["target"], "fast")))
    assert not same["k=4"] and not same["k=8"] and not same["k=16"], same


def test_negative_control_without_the_row_cap(q4k: dict[str, Path],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Each part of the exact layout is needed: whole blocks in one llama_decode..."""
    monkeypatch.setattr(runtime, "EXACT_ROWS", 512)
    same = block_layouts(repacked(context(q4k["target"], "exact")))
    assert not same["k=4"] and not same["beside another session"], same


def test_negative_control_prompt_cut_with_its_last_token(q4k: dict[str, Path],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """...and a prompt cut where its first row begins: decoded whole with its last token (as
    ``/v1/generate`` sends it) in one whole-batch decode, the target alone's prompt cache is
    not the one a session writes (its prompt less the last token, then that token with its
    drafts), and every row after it differs."""
    cut = runtime._prompt_length

    def with_last_token(segment: Segment) -> int:
        whole = segment.start == 0 and segment.rows_from == len(segment.token_ids) - 1
        return len(segment.token_ids) if whole else cut(segment)

    monkeypatch.setattr(runtime, "_prompt_length", with_last_token)
    # Whether a row rounds differently in the whole batch depends on the CPU's kernels and on
    # the values (on one AVX-512 machine PROMPT's rows came out equal): the layout is needed
    # where some prompt's rows differ, so the control tries a few.
    differ = []
    for prompt in [PROMPT, *CONTROL_PROMPTS]:
        monkeypatch.setattr(sys.modules[__name__], "PROMPT", prompt)
        same = block_layouts(repacked(context(q4k["target"], "exact")))
        differ.append(not any(same.values()))
    assert any(differ), differ


def test_prompts_go_in_aligned_whole_batches(q4k: dict[str, Path]) -> None:
    """An exact prompt is decoded in whole batches of its own (not 3 rows a decode), cut at
    multiples of PREFILL_CHUNK whether it comes whole or less its last token."""
    model = context(q4k["target"], "exact")
    prompt = [int(t) for t in np.random.default_rng(9).integers(2, 256, 150)]
    before = model.decodes
    model.decode([Segment(0, 0, prompt, len(prompt) - 1), Segment(1, 0, [7, 8], 0)])
    # 149 prompt tokens cut at 64 and 128, then the last token and the other row together
    assert model.decodes - before == 3 + 1
    model.decode([Segment(2, 0, prompt[:-1])])
    [alone] = model.decode([Segment(2, len(prompt) - 1, prompt[-1:], 0)])
    [whole] = model.decode([Segment(3, 0, prompt, len(prompt) - 1)])
    assert alone is not None and whole is not None and np.array_equal(alone, whole)


def test_negative_control_in_one_unified_cache(q4k: dict[str, Path]) -> None:
    """...and a stream per sequence: in one shared cache a session's cells lie after or
    between other sessions', and attention's vector sums group them otherwise."""
    model = context(q4k["target"], "fast")
    model.exact = True  # the exact plan of decodes, on the unified cache
    same = block_layouts(model)
    assert same["k=16"] and not same["beside another session"], same


def exact_settings(path: Path, kernels: str = "exact") -> Settings:
    return Settings(model=str(path), engine="llama-cpp", threads=1, max_draft_tokens=8,
                    max_context=256, kernels=kernels)  # type: ignore[arg-type]


# Six random prompts of 48 new tokens: enough near-ties that llama.cpp's whole-batch kernels
# change some greedy token (the negative control), while exact kernels change none.
PROMPTS = [[int(t) for t in ids] for ids in np.random.default_rng(5).integers(2, 256, (6, 6))]
LONG = 48


def differ(url: str, drafter: Path, loads: tuple[int, ...],
           want: list[list[int]] | None = None) -> list[str]:
    """Greedy generations that differ from the target alone's, at k = 1, 3, 8 and auto,
    alone (load 1) and among n sessions at once (load n)."""
    return speculative_vs_alone(url, drafter, str(drafter.parent), PROMPTS, LONG, loads,
                                DrafterOptions(engine="llama-cpp", threads=1), want=want)


@pytest.fixture(scope="module")
def server_settings(q4k: dict[str, Path]) -> Settings:
    return exact_settings(q4k["target"])


@pytest.fixture(scope="module")
def exact_alone(server: LiveServer, q4k: dict[str, Path]) -> list[list[int]]:
    return target_alone(server.url, str(q4k["drafter"].parent), PROMPTS, LONG)


@pytest.mark.parametrize("sessions", [1, 3, 7])
def test_greedy_speculation_equals_the_target_alone(sessions: int, server: LiveServer,
                                                    q4k: dict[str, Path],
                                                    exact_alone: list[list[int]]) -> None:
    """At k = 1, 3, 8 and auto, each prompt alone (1) or 3 or 7 sessions at once, after every
    earlier test's sessions on the same verifier."""
    assert SpecDecClient(server.url, None,
                         tokenizer=str(q4k["target"].parent)).info.kernels == "exact"
    assert differ(server.url, q4k["drafter"], (sessions,), exact_alone) == []


def test_logprobs_equal_the_target_alones_bit_for_bit(server: LiveServer,
                                                      q4k: dict[str, Path]) -> None:
    """The target's log-probabilities of speculation's tokens (and the best 3 at each) are the
    target alone's to the last bit: a block's rows are one-token steps'."""
    alone = SpecDecClient(server.url, None, tokenizer=str(q4k["target"].parent))
    client = SpecDecClient(server.url, str(q4k["drafter"]),
                           options=DrafterOptions(engine="llama-cpp", threads=1))
    for ids in PROMPTS[:2]:
        want = alone.baseline(ids, max_new_tokens=NEW, temperature=0, logprobs=3)
        for k in (3, 8):
            got = client.generate(ids, num_draft_tokens=k, max_new_tokens=NEW,
                                  temperature=0, logprobs=3)
            assert got.token_ids == want.token_ids
            assert got.logprobs == want.logprobs


def test_negative_control_fast_kernels_change_greedy_output(q4k: dict[str, Path]) -> None:
    """The same check on kernels="fast" (llama.cpp's whole batches, one unified cache)."""
    settings = exact_settings(q4k["target"], "fast")
    engine = load_engine(settings)
    if not engine.model.weights.extra_layouts:  # type: ignore[attr-defined]
        pytest.skip("llama.cpp offers no repacked layout on this CPU")
    with LiveServer(settings, engine) as fast:
        assert SpecDecClient(fast.url, None,
                             tokenizer=str(q4k["target"].parent)).info.kernels == "fast"
        assert differ(fast.url, q4k["drafter"], (1, 7)) != []
