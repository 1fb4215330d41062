"""A generation that ends inside a multi-byte character (issue #27): the streamed text must be
the plain answer's text, U+FFFD at the end included. Streaming holds back a trailing incomplete
UTF-8 sequence (a later token may complete it); when the generation ends, what is held back is
sent. Through the official `openai` client against `specdec serve`, and through
`specdec generate`'s printed text, on a tiny pair whose tokens are single bytes."""

from __future__ import annotations

import contextlib
import io

import openai
import orjson
import pytest

from drafter_client.api import SpecDecClient
from drafter_client.apps.cli import run
from drafter_client.gateway import GatewaySettings
from drafter_client.text import TextTracker
from tests.support.live_server import LiveServer, fp32_settings
from tests.support.tiny_models import save_byte_level
from verifier_service.settings import Settings

MODEL = "tiny-bytes"
SEEDS = range(16)


@pytest.fixture(scope="module")
def server_settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    """A tiny target whose tokens are single bytes."""
    folder = save_byte_level(tmp_path_factory.mktemp("bytes") / "target", seed=23)
    return fp32_settings(folder, max_draft_tokens=8)


@pytest.fixture(scope="module")
def gateway_client(server: LiveServer) -> SpecDecClient:
    return SpecDecClient(server.url, "ngram")


@pytest.fixture(scope="module")
def gateway_settings() -> GatewaySettings:
    return GatewaySettings(MODEL)


def test_a_stream_ending_mid_character_sends_its_last_bytes(oai: openai.OpenAI) -> None:
    ends_mid_character = 0
    for seed in SEEDS:
        ask = {"model": MODEL, "prompt": "ab", "max_tokens": 5, "temperature": 1.0,
               "seed": seed}
        plain = oai.completions.create(**ask).choices[0].text
        streamed = "".join(chunk.choices[0].text for chunk in
                           oai.completions.create(**ask, stream=True) if chunk.choices)
        assert streamed == plain, seed
        ends_mid_character += plain.endswith("\ufffd")
    assert ends_mid_character > 0  # the case under test happened


def test_the_cli_prints_the_last_bytes_too(server: LiveServer) -> None:
    ends_mid_character = 0
    for seed in SEEDS:
        common = ["generate", "--verifier-url", server.url, "--drafter", "ngram",
                  "--prompt", "ab", "--max-new-tokens", "5", "--temperature", "1.0",
                  "--seed", str(seed), "-k", "2"]  # a fixed k: the two runs draw alike
        printed, as_json = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert run(common) == 0
        with contextlib.redirect_stdout(as_json):
            assert run([*common, "--json"]) == 0
        text = orjson.loads(as_json.getvalue())["text"]
        assert printed.getvalue().startswith(text + "\n"), seed
        ends_mid_character += text.endswith("\ufffd")
    assert ends_mid_character > 0


def _byte_tracker(stops: list[str]) -> TextTracker:
    return TextTracker(lambda ids: bytes(ids).decode("utf-8", errors="replace"), stops)


def test_a_stop_string_never_matches_a_character_still_being_decoded() -> None:
    """Issue #42 item 8: a trailing U+FFFD is an emoji whose bytes have not all come yet, so
    ``stop: ["\\ufffd"]`` must not end the generation there; bytes that can never be a
    character (0xFF) still do."""
    emoji = list(" 🙂 🚀".encode())
    tracker = _byte_tracker(["\ufffd"])
    for byte in emoji:  # one byte a block: each emoji is half-decoded three times
        tracker.add([byte])
    assert not tracker.stopped
    assert tracker.text == " 🙂 🚀" and tracker.delta(final=True) == " 🙂 🚀"

    broken = _byte_tracker(["\ufffd"])
    broken.add([*b"ok ", 0xFF])
    assert not broken.stopped  # 0xFF could still be anything to a decoder that waits
    broken.add(list(b"x"))
    assert broken.stopped and broken.text == "ok " and broken.ids == [*b"ok ", 0xFF, *b"x"]


def test_a_stop_string_completed_by_a_later_block_is_found() -> None:
    tracker = _byte_tracker(["🚀!"])
    rocket = list("🚀".encode())
    tracker.add([*b"go ", *rocket[:2]])
    tracker.add([*rocket[2:], *b"!", *b"tail"])
    assert tracker.stopped and tracker.text == "go "
