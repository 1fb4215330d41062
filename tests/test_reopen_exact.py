"""A reopened session continues exactly as the lost one would have (#57 finding 1).

A client reopens a lost session (eviction, expiry, a restart, a failover) by writing every
committed token as a prompt. llama.cpp's exact kernels write a prompt in whole batches, whose
rows round otherwise than the one-token steps that generated those tokens, so the naive reopen
left a cache the undisturbed session never had. The create now says how many tokens were the
prompt (``prompt_length``) and the engine writes the rest in the layout of its steps. Checked
on the tiny Q4_K_M file whose matrices take a real file's kernels, at the rows (bit for bit,
with the naive reopen as the negative control) and end to end (greedy output with forced
reopens equal to the target alone's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from drafter_client import SpecDecClient
from drafter_client.api import DrafterOptions
from drafter_client.transport import HttpVerifier
from shared.engines.llama_cpp.runtime import GGUFWeights, LlamaModel, Segment
from shared.protocol.schema import VerifyRequest, VerifyResponse
from tests.support.live_server import LiveServer
from tests.support.tiny_gguf import save_quantized_gguf
from verifier_service.settings import Settings

NEW = 40
PROMPTS = [[int(t) for t in np.random.default_rng(seed).integers(2, 256, n)]
           for seed, n in ((21, 12), (22, 19), (23, 7), (24, 30))]


@pytest.fixture(scope="module")
def q4k(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_quantized_gguf(tmp_path_factory.mktemp("q4k") / "target", seed=0)


def exact_model(path: Path) -> LlamaModel:
    return LlamaModel(GGUFWeights(str(path), 1), n_seqs=3, seq_tokens=256, threads=1,
                      cells=3 * 256, exact=True)


def rows_after(model: LlamaModel, prompt: list[int]) -> tuple[np.ndarray, list[np.ndarray]]:
    """The undisturbed session (its prompt less the last token, then greedy steps), the
    naive reopen and the reopen with the steps' layout: the next row of each, after the same
    committed tokens."""
    model.decode([Segment(0, 0, prompt[:-1])])
    [rows] = model.decode([Segment(0, len(prompt) - 1, prompt[-1:], 0)])
    assert rows is not None
    generated = [int(rows[-1].argmax())]
    for i in range(NEW - 1):  # the generated tokens, in blocks of 3 and 1
        [rows] = model.decode([Segment(0, len(prompt) + i, generated[-1:], 0)])
        assert rows is not None
        generated.append(int(rows[-1].argmax()))
    committed = prompt + generated
    [undisturbed] = model.decode([Segment(0, len(committed) - 1, committed[-1:], 0)])
    reopened = []
    for seq, steps_from in ((1, None), (2, len(prompt) - 1)):
        model.decode([Segment(seq, 0, committed[:-1], None, steps_from)])
        [row] = model.decode([Segment(seq, len(committed) - 1, committed[-1:], 0)])
        assert row is not None
        reopened.append(row)
    for seq in range(3):
        model.remove(seq)
    assert undisturbed is not None
    return undisturbed, reopened


def test_a_reopen_writes_the_generated_tokens_as_their_steps_did(q4k: Path) -> None:
    model = exact_model(q4k)
    naive_differs = []
    for prompt in PROMPTS:
        undisturbed, (naive, reopened) = rows_after(model, prompt)
        assert np.array_equal(reopened, undisturbed)
        naive_differs.append(not np.array_equal(naive, undisturbed))
    # the negative control: written as a prompt, the same tokens leave another cache (whether
    # a row rounds otherwise in a whole batch depends on the CPU's kernels and the values,
    # so the control tries a few prompts)
    assert any(naive_differs), naive_differs


class LosingVerifier(HttpVerifier):
    """Loses the session every ``every`` verify calls (as an eviction or a restart would):
    the client must reopen it and go on."""

    def __init__(self, url: str, every: int, send_prompt_length: bool = True) -> None:
        super().__init__(url)
        self.every, self.calls, self.reopens = every, 0, 0
        self.send_prompt_length = send_prompt_length

    def verify(self, session_id: str, req: VerifyRequest) -> VerifyResponse:
        self.calls += 1
        if self.calls % self.every == 0:
            self.delete_session(session_id)
        return super().verify(session_id, req)

    def create_session(self, req: Any) -> Any:
        self.reopens += req.prompt_length is not None
        if not self.send_prompt_length:  # the naive reopen: everything as a prompt
            req = req.model_copy(update={"prompt_length": None})
        return super().create_session(req)


# Eight random prompts of 60 new tokens, the session lost every second call: on the machine
# this was written on, the naive reopen changed 17 of 40 such generations.
LOST = [[int(t) for t in np.random.default_rng(seed).integers(2, 256, 8 + seed % 23)]
        for seed in range(8)]


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.tiny_models import save_tiny_qwen2

    return save_tiny_qwen2(tmp_path_factory.mktemp("qwen2") / "target", 256)


@pytest.mark.slow  # sessions dropped and rebuilt all along a generation
@pytest.mark.parametrize("engine", ["llama-cpp", "int8"])
def test_greedy_output_with_lost_sessions_equals_the_target_alone(
        engine: str, request: pytest.FixtureRequest) -> None:
    """On int8 every row is computed as a one-token step computes it, a prompt's included
    (tests/test_int8_engine.py, with its negative control), so only the reopen that
    production sends is run there."""
    model: Path = request.getfixturevalue("q4k" if engine == "llama-cpp" else "qwen2")
    settings = Settings(model=str(model), engine=engine, threads=1,  # type: ignore[arg-type]
                        max_draft_tokens=8, max_context=256)
    tokenizer = str(model.parent if engine == "llama-cpp" else model)
    differ = {True: 0, False: 0}
    with LiveServer(settings) as server:
        for prompt in LOST:
            for send_prompt_length in (True, False) if engine == "llama-cpp" else (True,):
                losing = LosingVerifier(server.url, every=2,
                                        send_prompt_length=send_prompt_length)
                client = SpecDecClient(losing, "ngram", tokenizer=tokenizer,
                                       options=DrafterOptions(threads=1))
                alone = client.baseline(prompt, max_new_tokens=60).token_ids
                spoken = client.generate(prompt, max_new_tokens=60, num_draft_tokens=3)
                assert losing.reopens >= 2 and spoken.metrics.session_reopens >= 2
                differ[send_prompt_length] += spoken.token_ids != alone
    assert differ[True] == 0
    if engine == "llama-cpp":  # the negative control: the naive reopen parts from the target
        assert differ[False] > 0
