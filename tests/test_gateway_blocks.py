"""The gateway's ``specdec`` request extension, which the playground page stands on: per-block
events in the stream (every token's text and kind), a k policy per request, the target alone,
and ``/v1/specdec/settings``. Real gateway, real verifier, tiny pair."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.support.live_server import LiveServer
from tests.support.servers import ThreadedServer

MODEL = "tiny-gpt2"
KINDS = {"accepted", "recovered", "bonus", "target"}


def events(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed answer's events, up to [DONE]."""
    out = []
    with httpx.Client(timeout=60) as http, http.stream("POST", url, json=body) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return out
            out.append(orjson.loads(line[6:]))
    raise AssertionError("no [DONE]")


def answer(gateway: ThreadedServer, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(gateway.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def streamed_blocks(chunks: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]], str]:
    """(text from the chunks, the blocks, the tokens' texts joined: text after the last block
    belongs to the last token)."""
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    blocks = [c["specdec_block"] for c in chunks if "specdec_block" in c]
    token_text = "".join(piece for b in blocks for piece, _ in b["tokens"])
    tail = "".join(c["choices"][0]["text"] for c in chunks
                   if c["choices"] and "specdec_block" not in c)
    return text, blocks, token_text + tail


@pytest.mark.parametrize("k", [4, "auto", 0])
def test_blocks_cover_the_answer_token_by_token(gateway: ThreadedServer, k: int | str) -> None:
    """With ``specdec.blocks`` the stream's blocks hold one [text, kind] per completion token,
    whose texts make the answer; the text equals the plain answer without the extension (and
    with the gateway's own k): greedy output does not depend on k."""
    body = {"model": MODEL, "prompt": "the cat sat on", "max_tokens": 30, "temperature": 0}
    plain = answer(gateway, body)
    chunks = events(gateway.url + "/v1/completions",
                    {**body, "stream": True, "stream_options": {"include_usage": True},
                     "specdec": {"blocks": True, "k": k}})
    text, blocks, token_text = streamed_blocks(chunks)
    assert text == token_text == plain["choices"][0]["text"]
    tokens = [kind for b in blocks for _, kind in b["tokens"]]
    assert len(tokens) == plain["usage"]["completion_tokens"] == chunks[-1]["usage"][
        "completion_tokens"]
    assert set(tokens) <= KINDS
    assert [b["index"] for b in blocks] == list(range(len(blocks)))
    for b in blocks:
        assert b["accepted"] <= b["k"] and b["round_trip_ms"] >= b["verifier_ms"] >= 0
        kinds = [kind for _, kind in b["tokens"]]
        assert kinds[:b["accepted"]] == ["accepted"] * min(b["accepted"], len(kinds))
    if k == 4:
        assert all(b["k"] <= 4 for b in blocks) and "accepted" in tokens
    if k == 0:
        assert set(tokens) == {"target"} and all(b["k"] == 0 for b in blocks)


def test_blocks_with_a_stop_string_end_at_the_stop(gateway: ThreadedServer) -> None:
    """A stop string cuts the blocks' tokens where it cuts the text."""
    body = {"model": MODEL, "prompt": "the cat sat on", "max_tokens": 40, "temperature": 0}
    full = answer(gateway, body)["choices"][0]["text"]
    words = full.split()
    stop = words[len(words) // 2]
    plain = answer(gateway, {**body, "stop": stop})
    chunks = events(gateway.url + "/v1/completions",
                    {**body, "stop": stop, "stream": True, "specdec": {"blocks": True}})
    text, blocks, token_text = streamed_blocks(chunks)
    assert text == token_text == plain["choices"][0]["text"] == full[:full.index(stop)]
    assert sum(len(b["tokens"]) for b in blocks) == plain["usage"]["completion_tokens"]
    # the negative control: the unstopped answer has more tokens
    assert answer(gateway, body)["usage"]["completion_tokens"] > plain["usage"][
        "completion_tokens"]


def test_target_alone_and_plain_answers_with_blocks(gateway: ThreadedServer) -> None:
    """``target_alone`` answers from plain steps on the verifier (runs of them per call, no
    drafts): the same greedy text, blocks of k = 0 of the target's own tokens; a plain
    (non-streamed) answer carries its blocks too."""
    body = {"model": MODEL, "prompt": "def f ( x ) :", "max_tokens": 25, "temperature": 0}
    spec = answer(gateway, {**body, "specdec": {"blocks": True, "k": 3}})
    alone = answer(gateway, {**body, "specdec": {"blocks": True, "target_alone": True}})
    assert alone["choices"][0]["text"] == spec["choices"][0]["text"]
    assert alone["specdec"]["drafted_tokens"] == 0 and spec["specdec"]["drafted_tokens"] > 0
    blocks = alone["specdec_blocks"]
    assert {b["k"] for b in blocks} == {0}
    assert {kind for b in blocks for _, kind in b["tokens"]} == {"target"}
    assert sum(len(b["tokens"]) for b in blocks) == alone["usage"]["completion_tokens"]
    assert "".join(p for b in spec["specdec_blocks"] for p, _ in b["tokens"]) == \
        spec["choices"][0]["text"]
    assert "specdec_blocks" not in answer(gateway, body)


def test_a_stop_string_ends_the_targets_work_too(gateway: ThreadedServer,
                                                 gpt2_server: LiveServer) -> None:
    """The target alone stops at a stop string within one run of plain steps, as a
    speculative answer does (#57: a 3-token stop cost 1,999 steps of /v1/generate)."""
    body = {"model": MODEL, "prompt": "def f ( x ) :", "temperature": 0,
            "specdec": {"target_alone": True}}
    opening = answer(gateway, {**body, "max_tokens": 3})["choices"][0]["text"]
    assert opening.strip()

    def scored(bound: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        before = httpx.get(gpt2_server.url + "/v1/metrics").json()["scored_tokens"]
        reply = answer(gateway, bound)
        return httpx.get(gpt2_server.url + "/v1/metrics").json()["scored_tokens"] - before, reply

    work, stopped = scored({**body, "max_tokens": 120, "stop": [opening.strip()[-2:]]})
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert work <= 2 * 17  # at most a run in flight past the stop (1 + 16 steps a call)
    unstopped, _ = scored({**body, "max_tokens": 120})
    assert unstopped > 100  # the control: without the stop the target runs on


def test_seeded_sampling_target_alone_equals_speculation(gateway: ThreadedServer) -> None:
    """A seed couples the sampling (reproducible mode): the race's two legs sample the same
    text; without the seed's coupling they would not (the other seed differs)."""
    body = {"model": MODEL, "prompt": "the dog", "max_tokens": 20, "temperature": 1.0,
            "seed": 1234}
    spec = answer(gateway, {**body, "specdec": {"k": 4}})["choices"][0]["text"]
    alone = answer(gateway, {**body, "specdec": {"target_alone": True}})["choices"][0]["text"]
    other = answer(gateway, {**body, "seed": 99, "specdec": {"target_alone": True}})
    assert spec == alone != other["choices"][0]["text"]


@pytest.mark.parametrize(("specdec", "message"), [
    ({"k": 9}, "specdec.k must be in [0, 8]"),
    ({"k": -1}, "specdec.k: must be an integer"),
    ({"k": "fast"}, "specdec.k: must be an integer"),
    ({"blocks": "yes"}, "specdec.blocks"),
    ({"target_alone": 1}, "specdec.target_alone"),
])
def test_bad_specdec_options_get_400s_naming_them(gateway: ThreadedServer,
                                                  specdec: dict[str, Any], message: str) -> None:
    response = httpx.post(gateway.url + "/v1/completions", json={
        "model": MODEL, "prompt": "the cat", "max_tokens": 4, "specdec": specdec})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].startswith("specdec") and error["message"].startswith(message)


def test_settings_route_gives_the_clients_defaults(gateway: ThreadedServer,
                                                   gpt2_server: LiveServer) -> None:
    response = httpx.get(gateway.url + "/v1/specdec/settings")
    assert response.status_code == 200
    s = response.json()
    assert s["model"] == MODEL and s["k"] == "auto" and s["max_draft_tokens"] == 8
    assert s["sampling"] == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_tokens": 128,
                             "seed": 0}
    assert s["verifier_model"] == httpx.get(gpt2_server.url + "/v1/info").json()["model"]


def test_the_page_and_its_files(gateway: ThreadedServer) -> None:
    """The page and its two files, under a policy that runs scripts from them alone; nothing
    else is served from that folder."""
    page = httpx.get(gateway.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert '<script src="/playground/playground.js"' in page.text
    for name, kind in (("playground.js", "text/javascript"), ("playground.css", "text/css")):
        asset = httpx.get(gateway.url + "/playground/" + name)
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind)
    for name in ("__init__.py", "..%2F..%2Fapp.py", "nothing.js"):
        assert httpx.get(gateway.url + "/playground/" + name).status_code == 404, name


def test_the_official_client_reads_a_stream_with_blocks(gateway: ThreadedServer) -> None:
    """``specdec_block`` rides beside OpenAI's fields: the official client, sending the extension
    in ``extra_body``, reads the same text and keeps each block in ``model_extra``."""
    oai = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "the cat sat on"}]
    plain = oai.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                        temperature=0, max_tokens=20)
    chunks = list(oai.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=20,  # type: ignore[arg-type]
        stream=True, extra_body={"specdec": {"blocks": True, "k": 3}}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    blocks = [c.model_extra["specdec_block"] for c in chunks
              if c.model_extra and "specdec_block" in c.model_extra]
    assert text == plain.choices[0].message.content
    assert sum(len(b["tokens"]) for b in blocks) == plain.usage.completion_tokens  # type: ignore[union-attr]
