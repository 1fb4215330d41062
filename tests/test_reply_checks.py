"""A verify reply is checked before the loop reads it (drafter_client/reply_checks.py): every
field that does not fit the request is one clear SpecDecError naming it, and a reply that fits
passes; the verdict it carries must follow from its own scores by the acceptance rule. Each case
below breaks one thing in an otherwise valid reply."""

from __future__ import annotations

from typing import Any

import pytest

from drafter_client.reply_checks import check_reply, check_verdict, read_verdict
from drafter_client.transport import SpecDecError
from shared.protocol.acceptance import Block, Verdict
from shared.protocol.sampling import SamplingConfig
from shared.protocol.schema import PROTOCOL_VERSION, InfoResponse, VerifyRequest, VerifyResponse

INFO = InfoResponse(protocol_version=PROTOCOL_VERSION, model="m", vocab_size=10,
                    tokenizer_fingerprint="f", eos_token_ids=[0], max_context=64,
                    max_draft_tokens=8, max_new_tokens=64, dtype="float32", device="cpu")
GREEDY = SamplingConfig()
SAMPLED = SamplingConfig(temperature=1.0)


def chain(config: SamplingConfig, **request: Any) -> VerifyRequest:
    block = Block([3, 4], None, [-0.5, -0.5], 0.5, config, 5, None, request.pop("top", 0))
    return VerifyRequest.of(block, 2, request.pop("more", []))


def greedy_reply(**fields: Any) -> VerifyResponse:
    """Both drafts accepted, the bonus token 5 drawn: position 5 + 2 + 1."""
    return VerifyResponse(**{"num_accepted": 2, "target_logprobs": None,
                             "target_argmax": [3, 4, 5], "next_token": 5, "row": None,
                             "position": 8, "forward_ms": 1.0, **fields})


def sampled_reply(**fields: Any) -> VerifyResponse:
    return greedy_reply(**{"target_logprobs": [-0.1, -0.2], "target_argmax": None, **fields})


CASES = {
    "more accepted than drafted": (GREEDY, {}, {"num_accepted": 3, "position": 9},
                                   "num_accepted 3 for 2 drafts"),
    "greedy without argmax": (GREEDY, {}, {"target_argmax": [3, 4]}, "target_argmax needs 3"),
    "argmax outside the vocabulary": (GREEDY, {}, {"target_argmax": [3, 4, 10]},
                                      "target_argmax holds ids outside"),
    "sampled without log p": (SAMPLED, {}, {"target_logprobs": [-0.1]},
                              "target_logprobs needs 2"),
    "log p above 0": (SAMPLED, {}, {"target_logprobs": [-0.1, 0.5]},
                      "target_logprobs holds a value above 0"),
    "next token outside": (GREEDY, {}, {"next_token": 12}, "next_token 12 is outside"),
    "no token and no row": (GREEDY, {}, {"next_token": None}, "neither next_token nor"),
    "more tokens than asked": (GREEDY, {}, {"more_tokens": [1], "position": 9},
                               "more_tokens has 1 tokens for 0"),
    "more tokens outside": (GREEDY, {"more": [0.5]}, {"more_tokens": [11], "position": 9},
                            "more_tokens holds ids outside"),
    "position off": (GREEDY, {}, {"position": 7}, "position 7 after accepting 2 at 5"),
    "top ids short": (GREEDY, {"top": 2}, {"top_ids": [[1, 2]] * 2}, "top_ids does not hold"),
}
VALID = {"top ids short": {"top_ids": [[1, 2]] * 3}}  # what the case's request needs


@pytest.mark.parametrize("case", list(CASES))
def test_each_broken_field_is_one_clear_error(case: str) -> None:
    config, request, fields, message = CASES[case]
    req = chain(config, **request)
    valid = (greedy_reply if config.greedy else sampled_reply)(**VALID.get(case, {}))
    check_reply(valid, req, config.deterministic, INFO)  # the unbroken reply passes
    broken = (greedy_reply if config.greedy else sampled_reply)(**fields)
    with pytest.raises(SpecDecError, match="invalid reply: " + message):
        check_reply(broken, req, config.deterministic, INFO)


def test_a_tree_reply_must_walk_down_the_tree() -> None:
    block = Block([3, 4, 6], None, [-0.5] * 3, 0.5, GREEDY, 5, [-1, 0, -1], 0)
    req = VerifyRequest.of(block, 2, [])
    good = greedy_reply(target_argmax=[3, 4, 5, 1], accepted_path=[0, 1])
    check_reply(good, req, True, INFO)
    assert check_verdict(good.verdict(INFO.vocab_size), block) == 2
    for path, message in (([0, 2], "is not a path down the tree"), (None, "is missing"),
                          ([0], "has 1 nodes for num_accepted 2")):
        with pytest.raises(SpecDecError, match=message):
            check_reply(greedy_reply(target_argmax=[3, 4, 5, 1], accepted_path=path), req, True,
                        INFO)


def verdict_of(reply: VerifyResponse) -> Verdict:
    return reply.verdict(INFO.vocab_size)


def test_a_verdict_against_the_rule_is_a_protocol_mismatch() -> None:
    """The client applies the acceptance rule to the reply's own scores: a verifier that
    accepts a draft its scores reject (or the reverse) is caught, in both modes."""
    greedy = Block([3, 4], None, [-0.5, -0.5], 0.5, GREEDY, 5, None, 0)
    assert check_verdict(verdict_of(greedy_reply()), greedy) == 2
    with pytest.raises(SpecDecError, match="protocol mismatch"):
        check_verdict(verdict_of(greedy_reply(target_argmax=[3, 7, 5])), greedy)  # rule: 1
    sampled = Block([3, 4], None, [-0.05, -0.5], 0.5, SAMPLED, 5, None, 0)
    # log u = -0.05 < log p = -0.1 fails: the rule accepts none of the drafts
    with pytest.raises(SpecDecError, match="accepted 2 drafts where the acceptance rule gives 0"):
        check_verdict(verdict_of(sampled_reply()), sampled)
    assert check_verdict(verdict_of(sampled_reply(num_accepted=0, position=6)), sampled) == 0


def test_a_greedy_next_token_must_be_the_targets_choice() -> None:
    """In the deterministic modes the next token follows from the scores too: the argmax where
    the block stopped (a chain's, and a tree's)."""
    greedy = Block([3, 4], None, [-0.5, -0.5], 0.5, GREEDY, 5, None, 0)
    with pytest.raises(SpecDecError, match="verifier drew 6 where the target's choice is 5"):
        check_verdict(verdict_of(greedy_reply(next_token=6)), greedy)
    tree = Block([3, 4, 6], None, [-0.5] * 3, 0.5, GREEDY, 5, [-1, 0, -1], 0)
    stopped = greedy_reply(target_argmax=[3, 4, 5, 1], accepted_path=[0, 1], next_token=1)
    with pytest.raises(SpecDecError, match="verifier drew 1 where the target's choice is 5"):
        check_verdict(verdict_of(stopped), tree)


def test_read_verdict_checks_the_shape_then_the_rule() -> None:
    block = Block([3, 4], None, [-0.5, -0.5], 0.5, GREEDY, 5, None, 0)
    req = VerifyRequest.of(block, 2, [])
    assert read_verdict(greedy_reply(), req, block, INFO).num_accepted == 2
    with pytest.raises(SpecDecError, match="invalid reply: num_accepted 3 for 2 drafts"):
        read_verdict(greedy_reply(num_accepted=3, position=9), req, block, INFO)
    with pytest.raises(SpecDecError, match="protocol mismatch"):
        read_verdict(greedy_reply(target_argmax=[3, 7, 5]), req, block, INFO)
