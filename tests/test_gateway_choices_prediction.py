"""`n` choices and Predicted Outputs (`prediction`) on the gateway, through the official
`openai` client on the tiny GPT-2 pair; and the prediction drafter's bookkeeping."""

from __future__ import annotations

from typing import Any

import openai
import pytest
import torch

from drafter_client.prediction import PredictionDrafter
from shared.engines.drafter import Draft, Drafter
from shared.protocol.sampling import SamplingConfig
from tests.test_gateway import MODEL, error_of

CHAT: Any = [{"role": "user", "content": "the cat sat on"}]


def chat(oai: openai.OpenAI, **kwargs: Any) -> Any:
    return oai.chat.completions.create(model=MODEL, messages=CHAT, **kwargs)


def stream_choices(chunks: Any) -> tuple[dict[int, str], dict[int, str], Any]:
    """(text per choice, finish reason per choice, usage) of a streamed answer."""
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usage = None
    for chunk in chunks:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
    return texts, finishes, usage


# -- n ---------------------------------------------------------------------------------------------

def test_n_seeded_choices_are_the_single_requests_with_seeds_counted_up(
        oai: openai.OpenAI) -> None:
    kwargs: Any = {"temperature": 0.9, "top_p": 0.95, "max_tokens": 16}
    reply = chat(oai, n=3, seed=1234, **kwargs)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    singles = [chat(oai, seed=1234 + i, **kwargs) for i in range(3)]
    assert ([c.message.content for c in reply.choices]
            == [s.choices[0].message.content for s in singles])
    assert len({c.message.content for c in reply.choices}) > 1  # the seeds differ
    assert reply.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert reply.usage.prompt_tokens == singles[0].usage.prompt_tokens  # counted once
    assert isinstance((reply.model_extra or {})["specdec"], list)
    again = chat(oai, n=3, seed=1234, **kwargs)
    assert [c.message.content for c in again.choices] == [
        c.message.content for c in reply.choices]
    texts, finishes, usage = stream_choices(chat(
        oai, n=3, seed=1234, stream=True, stream_options={"include_usage": True}, **kwargs))
    assert texts == {c.index: c.message.content for c in reply.choices}
    assert finishes == {c.index: c.finish_reason for c in reply.choices}
    assert usage.completion_tokens == reply.usage.completion_tokens


def test_n_on_completions(oai: openai.OpenAI) -> None:
    reply = oai.completions.create(model=MODEL, prompt="the dog ran to", temperature=0,
                                   max_tokens=12, n=2)
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.choices[0].text == reply.choices[1].text  # greedy: one answer, twice
    one = oai.completions.create(model=MODEL, prompt="the dog ran to", temperature=0,
                                 max_tokens=12)
    assert reply.choices[0].text == one.choices[0].text
    assert reply.usage.completion_tokens == 2 * one.usage.completion_tokens


@pytest.mark.parametrize("n", [0, 17])
def test_n_out_of_bounds_is_a_400_naming_n(oai: openai.OpenAI, n: int) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(oai, n=n, max_tokens=4)
    assert error_of(info.value)["param"] == "n"


# -- prediction ------------------------------------------------------------------------------------

def predicted(reply: Any) -> tuple[int, int]:
    details = reply.usage.completion_tokens_details
    return details.accepted_prediction_tokens, details.rejected_prediction_tokens


def edited(text: str) -> str:
    """``text`` with a word in its middle replaced: what the target will not say."""
    words = text.split(" ")
    middle = len(words) // 2
    words[middle] = "zebra" if words[middle] != "zebra" else "yak"
    return " ".join(words)


def test_a_prediction_changes_the_speed_and_nothing_else(oai: openai.OpenAI) -> None:
    ref = chat(oai, temperature=0, max_tokens=40).choices[0].message.content
    assert ref and len(ref.split(" ")) >= 6, ref
    right = chat(oai, temperature=0, max_tokens=40,
                 prediction={"type": "content", "content": ref})
    assert right.choices[0].message.content == ref
    accepted, rejected = predicted(right)
    assert accepted > 0 and accepted >= rejected
    wrong = edited(ref)
    assert wrong != ref  # negative control: copying the prediction would change the answer
    for prediction in (wrong, "an unrelated text about nothing at all", ""):
        reply = chat(oai, temperature=0, max_tokens=40,
                     prediction={"type": "content", "content": [
                         {"type": "text", "text": prediction}]})
        assert reply.choices[0].message.content == ref, prediction
    edited_reply = chat(oai, temperature=0, max_tokens=40,
                        prediction={"type": "content", "content": wrong})
    assert sum(predicted(edited_reply)) > 0  # its drafts were sent and decided
    texts, _, usage = stream_choices(chat(
        oai, temperature=0, max_tokens=40, stream=True, stream_options={"include_usage": True},
        prediction={"type": "content", "content": wrong}))
    assert texts == {0: ref}
    assert usage.completion_tokens_details.accepted_prediction_tokens > 0


def test_seeded_sampling_with_a_prediction_is_the_answer_without(oai: openai.OpenAI) -> None:
    kwargs: Any = {"temperature": 0.8, "seed": 77, "max_tokens": 24}
    ref = chat(oai, **kwargs).choices[0].message.content
    with_prediction = chat(oai, prediction={"type": "content", "content": edited(ref)},
                           **kwargs)
    assert with_prediction.choices[0].message.content == ref


def test_no_prediction_no_prediction_counts(oai: openai.OpenAI) -> None:
    assert chat(oai, temperature=0, max_tokens=4).usage.completion_tokens_details is None


@pytest.mark.parametrize(("prediction", "param"), [
    ({"type": "content", "content": "the cat " * 400}, "prediction"),
    ({"type": "text", "content": "x"}, "prediction.type"),
    ({"type": "content"}, "prediction.content"),
])
def test_bad_predictions_are_400s_naming_the_field(oai: openai.OpenAI, prediction: Any,
                                                   param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(oai, max_tokens=4, prediction=prediction)
    assert error_of(info.value)["param"] == param
    assert chat(oai, temperature=0, max_tokens=2).usage.completion_tokens >= 1  # still serves


class Echo(Drafter):
    """Proposes ``k`` copies of 99; records what it was told."""

    name = "echo"

    def __init__(self) -> None:
        self.committed: list[int] = []

    def reset(self, prompt_ids: list[int], encoder_ids: list[int] | None = None) -> None:
        self.committed = list(prompt_ids)

    def propose(self, k: int, config: SamplingConfig, generator: torch.Generator) -> Draft:
        return Draft([99] * k, None, None)

    def commit(self, tokens: list[int]) -> None:
        self.committed.extend(tokens)


def test_the_prediction_drafter_follows_leaves_and_rejoins_the_prediction() -> None:
    inner, generator, config = Echo(), torch.Generator(), SamplingConfig()
    drafter = PredictionDrafter(inner, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    drafter.reset([50, 51])
    assert drafter.propose(4, config, generator).ids[:4] == [1, 2, 3, 4]
    drafter.commit([1, 2, 3, 40])  # 3 accepted, the 4th rejected (40 recovered)
    assert (drafter.counts.accepted, drafter.counts.rejected) == (3, 9)
    assert drafter.propose(3, config, generator).ids == [99, 99, 99]  # the inner drafter
    drafter.commit([41, 6, 7])  # the inner's block: no prediction counts
    assert (drafter.counts.accepted, drafter.counts.rejected) == (3, 9)
    drafter.commit([8])  # the tail 6 7 8 ... is not 4 tokens of the prediction yet
    assert drafter.propose(2, config, generator).ids == [99, 99]
    drafter.commit([9])  # 7 8 9 ... no: the tail is [6, 7, 8, 9]: rejoined after 9
    assert drafter.propose(2, config, generator).ids == [10, 11, 12]
    drafter.commit([10, 11, 12, 0])  # all passed, then a bonus token
    assert (drafter.counts.accepted, drafter.counts.rejected) == (6, 9)
    assert inner.committed == [50, 51, 1, 2, 3, 40, 41, 6, 7, 8, 9, 10, 11, 12, 0]
    assert drafter.propose(2, config, generator).ids == [99, 99]  # past its end
