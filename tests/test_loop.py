"""The speculative loop against the verifier's jobs in this process (no HTTP): block outcomes,
greedy exactness, and a session lost mid-generation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from drafter_client import SpecDecClient
from drafter_client.policy import BlockPlan
from drafter_client.speculative import VerifierSession, speculative_block
from drafter_client.transport import SpecDecError
from shared.protocol.schema import SamplingParams
from tests.support.in_process import InProcessVerifier
from tests.support.live_server import fp32_settings
from tests.support.tiny_models import hf_greedy


@pytest.fixture(scope="module")
def verifier(tiny_models: dict[str, Path]) -> InProcessVerifier:
    return InProcessVerifier.load(fp32_settings(tiny_models["llama-target"],
                                                max_draft_tokens=8, max_context=64))


@pytest.fixture(scope="module")
def client(verifier: InProcessVerifier, tiny_models: dict[str, Path]) -> SpecDecClient:
    return SpecDecClient(verifier, str(tiny_models["llama-drafter"]), dtype="float32",
                         device="cpu")


def test_block_outcome_is_accepted_drafts_plus_one(client: SpecDecClient,
                                                   verifier: InProcessVerifier) -> None:
    session = VerifierSession(verifier, SamplingParams(), [2, 3, 4])
    session.open()
    assert client.drafter is not None
    client.drafter.reset(session.committed)
    outcome = speculative_block(session, client.drafter, BlockPlan(4), torch.Generator(),
                                client.info)
    assert len(outcome.draft_ids) == 4
    assert outcome.tokens[:-1] == outcome.draft_ids[:outcome.num_accepted]
    assert len(outcome.tokens) == outcome.num_accepted + 1 or outcome.finished
    assert session.committed == [2, 3, 4]  # the block commits nothing itself
    session.close()
    assert len(verifier.jobs.sessions) == 0


def test_greedy_equals_target_and_survives_a_lost_session(
        client: SpecDecClient, verifier: InProcessVerifier,
        tiny_models: dict[str, Path]) -> None:
    prompt = client.encode("a big red dog ran to the")
    expected = hf_greedy(tiny_models["llama-target"], prompt, 24)
    cut = next((i + 1 for i, t in enumerate(expected) if t in client.info.eos_token_ids),
               len(expected))
    lost = []
    created: list[str] = []
    create = verifier.create_session

    def record(req: Any) -> Any:
        reply = create(req)
        created.append(reply.session_id)
        return reply

    verifier.create_session = record  # type: ignore[method-assign]

    def lose_session(_: list[int]) -> None:  # the verifier forgets it after the 2nd block
        lost.append(True)
        if len(lost) == 2:
            verifier.jobs.sessions.discard(created[-1])

    try:
        result = client.generate(prompt, num_draft_tokens=3, max_new_tokens=24,
                                 on_tokens=lose_session)
    finally:
        del verifier.create_session
    assert result.token_ids == expected[:cut]
    assert result.metrics.session_reopens == 1


def test_a_drafter_must_subclass_drafter(verifier: InProcessVerifier,
                                         tiny_models: dict[str, Path]) -> None:
    """Optional drafter features are declared on the Drafter base class, never probed: an
    object that only looks like a drafter is refused when the client is built."""
    class Lookalike:
        name = "lookalike"

        def reset(self, prompt_ids: list[int], encoder_ids: list[int] | None = None) -> None:
            pass

    with pytest.raises(SpecDecError, match="subclass Drafter"):
        SpecDecClient(verifier, Lookalike(), tokenizer=str(tiny_models["llama-target"]))  # type: ignore[arg-type]


def test_a_new_session_writes_its_prompt_with_its_first_block(
        client: SpecDecClient, verifier: InProcessVerifier) -> None:
    """A create runs no forward; the first verify writes the prompt in the same forward as its
    block (that the output is still the target's is what the greedy tests check)."""
    session = VerifierSession(verifier, SamplingParams(), [2, 3, 4, 5, 6])
    session.open()
    assert session.session_id is not None
    stored = verifier.jobs.sessions.peek(session.session_id)
    assert stored is not None and stored.pending == [2, 3, 4, 5]
    assert client.drafter is not None
    client.drafter.reset(session.committed)
    speculative_block(session, client.drafter, BlockPlan(2), torch.Generator(), client.info)
    assert stored.pending == []
    session.close()
