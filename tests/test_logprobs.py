"""logprobs: the target's raw log-probabilities of the tokens speculation returns, as the target
alone reports them on the same verifier, and on the gateway in OpenAI's shapes. The tiny fp32
GPT-2 pair runs on the transformers engine, whose float32 kernels round by row count
(``kernels: inexact``): values agree within 1e-5 (2e-6 measured). On the exact llama.cpp engine
they are equal bit for bit (``tests/test_llama_exact.py``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from drafter_client.api import SpecDecClient
from drafter_client.transport import SpecDecError
from shared.protocol.schema import GenerateRequest, VerifyRequest
from tests.support.live_server import LiveServer
from tests.test_gateway import MODEL, error_of

PROMPT = "the cat sat on the"


@pytest.fixture(scope="module")
def client(gpt2_server: LiveServer, tiny_models: dict[str, Path]) -> SpecDecClient:
    return SpecDecClient(gpt2_server.url, str(tiny_models["gpt2-drafter"]))


@pytest.mark.parametrize("k", [0, 3, 8])
def test_greedy_logprobs_equal_the_target_alones(client: SpecDecClient, k: int) -> None:
    alone = client.baseline(PROMPT, max_new_tokens=24, temperature=0, logprobs=5)
    spec = client.generate(PROMPT, num_draft_tokens=k, max_new_tokens=24, temperature=0,
                           logprobs=5)
    assert spec.token_ids == alone.token_ids
    assert spec.logprobs is not None and alone.logprobs is not None
    for got, want in zip(spec.logprobs, alone.logprobs, strict=True):
        assert got.token == want.token
        assert [i for i, _ in got.top] == [i for i, _ in want.top]
        assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert [v for _, v in got.top] == pytest.approx([v for _, v in want.top], abs=1e-5)
    for entry in alone.logprobs or []:
        assert len(entry.top) == 5 and entry.top[0][1] == max(v for _, v in entry.top)
        assert entry.top[0][0] == entry.token  # greedy: the token is its row's best
    assert len(alone.logprobs or []) == len(alone.token_ids)


def teacher_forced(target: Path, prompt_ids: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens)] raw log-probabilities of ``tokens`` after the prompt, one forward."""
    model = AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_sampled_logprobs_are_the_raw_target_distributions(
        client: SpecDecClient, tiny_models: dict[str, Path]) -> None:
    """Unseeded sampling with the model drafter: recovered tokens are drawn by the client and
    found in the support the verifier sent; every value is the raw (untempered) target's."""
    result = client.generate(PROMPT, num_draft_tokens=4, max_new_tokens=32, temperature=0.7,
                             top_k=20, seed=5, logprobs=2)
    reference = teacher_forced(tiny_models["gpt2-target"], result.prompt_token_ids,
                               result.token_ids)
    reported = torch.tensor([e.logprob for e in result.logprobs or []])
    assert torch.allclose(reported, reference, atol=1e-4)
    tempered = torch.log_softmax(reference / 0.7, -1)  # what a processed row would give
    # negative control: the processed distribution's values are far from the raw ones
    assert not torch.allclose(reported, tempered, atol=1e-2)
    assert result.metrics.verify_calls < len(result.token_ids)  # blocks did pass drafts


def test_verify_and_generate_refuse_more_than_20_alternatives() -> None:
    with pytest.raises(ValueError, match="logprobs"):
        VerifyRequest(position=2, last_token=1, final_uniform=0.5, logprobs=21)
    with pytest.raises(ValueError, match="logprobs"):
        GenerateRequest(prompt_ids=[1], logprobs=21)


def test_beam_search_with_logprobs_is_refused(client: SpecDecClient) -> None:
    with pytest.raises(SpecDecError, match="logprobs"):
        client.baseline(PROMPT, max_new_tokens=4, temperature=0, num_beams=2, logprobs=1)


# -- the gateway -------------------------------------------------------------------------------


def test_chat_logprobs_in_openais_shape(oai: openai.OpenAI, client: SpecDecClient) -> None:
    messages: Any = [{"role": "user", "content": PROMPT}]
    reply = oai.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                        max_tokens=16, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert content is not None
    assert "".join(t.token for t in content) == reply.choices[0].message.content
    ids = client.encode_chat([{"role": "user", "content": PROMPT}])
    alone = client.baseline(ids, max_new_tokens=16, temperature=0, logprobs=3)
    assert [t.logprob for t in content] == pytest.approx(
        [e.logprob for e in alone.logprobs or []], abs=1e-5)
    for token in content:
        assert len(token.top_logprobs) == 3
        assert token.top_logprobs[0].logprob == token.logprob  # greedy: the best
        assert token.bytes == list(token.token.encode())
    streamed = oai.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                           max_tokens=16, logprobs=True, top_logprobs=3,
                                           stream=True)
    pieces = [t for chunk in streamed for choice in chunk.choices
              if choice.logprobs is not None for t in choice.logprobs.content or []]
    assert [t.token for t in pieces] == [t.token for t in content]
    assert [t.logprob for t in pieces] == pytest.approx([t.logprob for t in content], abs=1e-5)
    plain = oai.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                        max_tokens=4)
    assert plain.choices[0].logprobs is None  # not asked: not sent


def test_completion_logprobs_in_openais_shape(oai: openai.OpenAI) -> None:
    reply = oai.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=12,
                                   logprobs=2)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert "".join(logprobs.tokens) == reply.choices[0].text
    assert len(logprobs.token_logprobs or []) == len(logprobs.tokens)
    assert all(len(top) == 2 for top in logprobs.top_logprobs or [])
    offsets = logprobs.text_offset or []
    assert offsets == [sum(map(len, logprobs.tokens[:i])) for i in range(len(offsets))]
    assert all(math.isfinite(v) and v <= 0 for v in logprobs.token_logprobs or [])


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
])
def test_bad_logprobs_are_400s(oai: openai.OpenAI, kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                    max_tokens=2, **kwargs)
    assert error_of(info.value)["param"] == param
    with pytest.raises(openai.BadRequestError) as completion:
        oai.completions.create(model=MODEL, prompt="x", max_tokens=2, logprobs=6)
    assert error_of(completion.value)["param"] == "logprobs"
