"""The streamed text is decoded incrementally: the same text as one decode of every id, at
linear cost (#57 finding 11: 8x the tokens cost 31x the gateway's CPU)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from drafter_client.text import TextTracker
from tests.support.tiny_models import build_byte_tokenizer


def counting(decode: Callable[[list[int]], str]) -> tuple[Callable[[list[int]], str], list[int]]:
    """``decode``, counting the ids it is given."""
    seen = [0]

    def counted(ids: list[int]) -> str:
        seen[0] += len(ids)
        return decode(ids)
    return counted, seen


def utf8(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def sentencepiece_like(ids: list[int]) -> str:
    """A decoder that drops the leading space of its first piece, as SentencePiece's does: a
    piece decoded alone differs from the same piece after others."""
    return "".join(f" w{i}" for i in ids).removeprefix(" ")


@pytest.mark.parametrize("decode", [utf8, sentencepiece_like], ids=["utf8", "sentencepiece"])
@pytest.mark.parametrize("seed", range(5))
def test_block_by_block_text_is_the_whole_decode(decode: Callable[[list[int]], str],
                                                 seed: int) -> None:
    rng = random.Random(seed)
    text = "héllo wörld 🙂 naïve ünïcode 🚀 " * 20
    ids = list(text.encode()) if decode is utf8 else [rng.randrange(50) for _ in range(400)]
    tracker, streamed = TextTracker(decode), []
    at = 0
    while at < len(ids):
        k = rng.randint(1, 6)
        tracker.add(ids[at:at + k])
        at += k
        assert tracker.text == decode(ids[:at])
        streamed.append(tracker.delta())
    streamed.append(tracker.delta(final=True))
    assert "".join(streamed) == decode(ids)


def test_a_byte_level_tokenizer_streams_its_own_decode() -> None:
    tokenizer = build_byte_tokenizer(64)
    ids = [random.Random(1).randrange(2, 64) for _ in range(600)]
    tracker = TextTracker(tokenizer.decode)
    for at in range(0, len(ids), 3):
        tracker.add(ids[at:at + 3])
    assert tracker.text == tokenizer.decode(ids)


def test_stops_are_found_as_before_across_the_anchor() -> None:
    tracker = TextTracker(utf8, ["STOP"])
    tracker.add(list(b"x" * 100))
    tracker.add(list(b"ST"))
    tracker.add(list(b"OP and more"))
    assert tracker.stopped and tracker.text == "x" * 100


def test_the_work_grows_linearly_with_the_answer() -> None:
    """Ids decoded per id generated, at 1,000 and 8,000 ids, token by token (what
    ``specdec.blocks`` does): flat, not growing with the length (it grew 8x before)."""
    per_id = []
    for n in (1000, 8000):
        decode, seen = counting(utf8)
        tracker = TextTracker(decode)
        for _ in range(n):
            tracker.add([ord("a")])
            tracker.delta()
        per_id.append(seen[0] / n)
    assert per_id[1] < 1.5 * per_id[0] and per_id[1] < 100, per_id
