"""`specdec serve`: the OpenAI-compatible gateway, driven by the official `openai` package
against a real gateway and a real verifier on the tiny pair."""

from __future__ import annotations

import contextlib
import io
import re
import threading
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from drafter_client.api import SpecDecClient
from drafter_client.apps.cli import run
from drafter_client.gateway import GatewaySettings, create_gateway
from tests.support.live_server import LiveServer, fp32_settings
from tests.support.prometheus import scrape, wait_for_idle
from tests.support.servers import ThreadedServer

MODEL = "tiny-gpt2"
ROOT = Path(__file__).resolve().parent.parent


def cli_generate(verifier_url: str, drafter: Path, prompt: str, *extra: str) -> dict[str, Any]:
    """`specdec generate --json`, in-process."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = run(["generate", "--verifier-url", verifier_url, "--drafter", str(drafter),
                    "--prompt", prompt, "--json", *extra])
    assert code == 0
    return orjson.loads(out.getvalue())  # type: ignore[no-any-return]


def stream_text(chunks: Any) -> tuple[str, str | None, Any, dict[str, Any] | None]:
    """(text, finish_reason, usage, specdec metrics) of a streamed answer."""
    text, finish, usage, extra = [], None, None, None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = getattr(choice, "delta", None)
            piece = piece.content if piece is not None else choice.text
            text.append(piece or "")
            if choice.finish_reason is not None:
                finish = choice.finish_reason
                extra = (chunk.model_extra or {}).get("specdec")
    return "".join(text), finish, usage, extra


@pytest.mark.parametrize("prompt", ["the cat sat on", "def f ( x ) :"])
def test_greedy_chat_equals_specdec_generate(oai: openai.OpenAI, gpt2_server: LiveServer,
                                             tiny_models: dict[str, Path], prompt: str) -> None:
    ref = cli_generate(gpt2_server.url, tiny_models["gpt2-drafter"], prompt, "--chat",
                       "--max-new-tokens", "24")
    messages: Any = [{"role": "user", "content": prompt}]
    reply = oai.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                        max_tokens=24)
    choice = reply.choices[0]
    assert choice.message.content == ref["text"]
    assert choice.message.role == "assistant"
    assert choice.finish_reason == ("stop" if ref["finish_reason"] == "stop" else "length")
    assert reply.usage is not None
    assert reply.usage.completion_tokens == len(ref["token_ids"])
    assert reply.usage.prompt_tokens == len(ref["prompt_token_ids"])
    extra = reply.model_extra or {}
    assert extra["specdec"]["new_tokens"] == len(ref["token_ids"])
    assert extra["specdec"]["verify_calls"] >= 1

    text, finish, usage, metrics = stream_text(oai.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=24, stream=True,
        stream_options={"include_usage": True}))
    assert text == ref["text"]
    assert finish == choice.finish_reason
    assert usage is not None and usage.completion_tokens == len(ref["token_ids"])
    assert metrics is not None and metrics["new_tokens"] == len(ref["token_ids"])


def test_completions_text_and_token_ids(oai: openai.OpenAI, gpt2_server: LiveServer,
                                        tiny_models: dict[str, Path]) -> None:
    ref = cli_generate(gpt2_server.url, tiny_models["gpt2-drafter"], "the dog ran to",
                       "--max-new-tokens", "16")
    reply = oai.completions.create(model=MODEL, prompt="the dog ran to", temperature=0,
                                   max_tokens=16)
    assert reply.choices[0].text == ref["text"]
    by_ids = oai.completions.create(model=MODEL, prompt=ref["prompt_token_ids"],
                                    temperature=0, max_tokens=16)
    assert by_ids.choices[0].text == ref["text"]
    text, finish, _, _ = stream_text(oai.completions.create(
        model=MODEL, prompt="the dog ran to", temperature=0, max_tokens=16, stream=True))
    assert text == ref["text"]
    assert finish == reply.choices[0].finish_reason
    default = oai.completions.create(model=MODEL, prompt="the dog ran to", temperature=0)
    assert default.usage is not None and default.usage.completion_tokens <= 16  # OpenAI's 16


def test_stop_strings_cut_the_text(oai: openai.OpenAI, gpt2_server: LiveServer,
                                   tiny_models: dict[str, Path]) -> None:
    ref = cli_generate(gpt2_server.url, tiny_models["gpt2-drafter"], "the cat sat on",
                       "--max-new-tokens", "24")
    words = ref["text"].split(" ")
    assert len(words) >= 8, ref["text"]
    stop = f" {words[5]}"  # cut before the 6th word's first appearance (after the first word)
    expected = ref["text"][: ref["text"].index(stop)]
    for stream in (False, True):
        kwargs: Any = {"model": MODEL, "prompt": "the cat sat on", "temperature": 0,
                       "max_tokens": 24, "stop": [stop, "never appears"]}
        if stream:
            text, finish, _, _ = stream_text(oai.completions.create(stream=True, **kwargs))
        else:
            reply = oai.completions.create(**kwargs)
            text, finish = reply.choices[0].text, reply.choices[0].finish_reason
            assert reply.usage is not None
            assert reply.usage.completion_tokens < len(ref["token_ids"])
        assert text == expected
        assert finish == "stop"


def test_seeded_sampling_is_reproducible(oai: openai.OpenAI) -> None:
    kwargs: Any = {"model": MODEL, "messages": [{"role": "user", "content": "the big red"}],
                   "temperature": 0.9, "top_p": 0.95, "seed": 1234, "max_tokens": 20}
    first = oai.chat.completions.create(**kwargs).choices[0].message.content
    again = oai.chat.completions.create(**kwargs).choices[0].message.content
    streamed, _, _, _ = stream_text(oai.chat.completions.create(stream=True, **kwargs))
    assert first == again == streamed
    texts = {oai.chat.completions.create(**{**kwargs, "seed": seed}).choices[0].message.content
             for seed in range(6)}
    assert len(texts) > 1  # the seed is used


def test_concurrent_requests_each_get_their_own_answer(
        oai: openai.OpenAI, gpt2_server: LiveServer, tiny_models: dict[str, Path]) -> None:
    prompts = ["the cat", "a dog ran", "big red mat", "x = 1", "if x :", "return y + 2"]
    refs = {p: cli_generate(gpt2_server.url, tiny_models["gpt2-drafter"], p, "--chat",
                            "--max-new-tokens", "20")["text"] for p in prompts}
    assert ask_at_once(oai, prompts * 2, max_tokens=20) == refs


def ask_at_once(oai: openai.OpenAI, prompts: list[str], max_tokens: int) -> dict[str, str | None]:
    """Each prompt's greedy chat answer, all asked at once from threads."""
    answers: dict[str, str | None] = {}

    def ask(prompt: str) -> None:
        reply = oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0,
            max_tokens=max_tokens)
        answers[prompt] = reply.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return answers


def test_concurrent_requests_with_cuda_graph_drafters(
        gpt2_server: LiveServer, tiny_models: dict[str, Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #24: with the client's ``--cuda-graphs`` each gateway worker thread builds a pooled
    drafter and captures its buckets while other threads draft (captures are serialised:
    tests/test_graphs.py). Here on CPU the same buckets run eagerly: concurrent requests still
    get the greedy answers ``specdec generate --cuda-graphs`` gives one at a time."""
    from drafter_client.api import DrafterOptions
    from shared.engines.transformers.pooled_drafter import PooledDrafter

    built: list[int] = []
    original = PooledDrafter.__init__

    def counted(self: PooledDrafter, *args: Any, **kwargs: Any) -> None:
        built.append(threading.get_ident())
        original(self, *args, **kwargs)
    monkeypatch.setattr(PooledDrafter, "__init__", counted)
    drafter = tiny_models["gpt2-drafter"]
    prompts = ["the cat", "a dog ran", "x = 1", "return y + 2"]
    refs = {p: cli_generate(gpt2_server.url, drafter, p, "--chat", "--max-new-tokens", "16",
                            "--cuda-graphs")["text"] for p in prompts}
    client = SpecDecClient(gpt2_server.url, str(drafter), options=DrafterOptions(cuda_graphs=True))
    with ThreadedServer(create_gateway(client, GatewaySettings(MODEL))) as server:
        oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        answers = ask_at_once(oai, prompts * 2, max_tokens=16)
    assert answers == refs
    assert len(set(built)) >= 2  # pooled drafters built on more than one thread


def test_models_route(oai: openai.OpenAI) -> None:
    models = oai.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert oai.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("other")


def error_of(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.response.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    return body["error"]  # type: ignore[no-any-return]


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"n": 17}, "n"),
    ({"temperature": 3.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logprobs": 3}, "logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
])
def test_bad_chat_requests_get_openai_400s(oai: openai.OpenAI, kwargs: dict[str, Any],
                                           param: str) -> None:
    body: Any = {"model": MODEL, "messages": [{"role": "user", "content": "the cat"}], **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(**body)
    error = error_of(info.value)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error


def test_other_bad_requests(oai: openai.OpenAI, gateway: ThreadedServer) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        oai.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    assert error_of(info.value)["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as too_long:
        oai.completions.create(model=MODEL, prompt=[3] * 400, max_tokens=4)
    assert error_of(too_long.value)["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as bad_id:
        oai.completions.create(model=MODEL, prompt=[3, 64], max_tokens=4)
    assert error_of(bad_id.value)["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as batch:
        oai.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=4)
    assert error_of(batch.value)["param"] == "prompt"
    raw = httpx.post(gateway.url + "/v1/chat/completions", content=b"{not json",
                     headers={"content-type": "application/json"})
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(gateway.url + "/v1/nothing").status_code == 404
    # the gateway still serves after all of that
    reply = oai.completions.create(model=MODEL, prompt="the cat", temperature=0, max_tokens=4)
    assert reply.usage is not None and reply.usage.completion_tokens >= 1


def test_gateway_prometheus_metrics(oai: openai.OpenAI, gateway: ThreadedServer) -> None:
    before = scrape(gateway.url)
    replies = [oai.chat.completions.create(model=MODEL, temperature=0, max_tokens=12,
                                           messages=[{"role": "user", "content": p}])
               for p in ("the cat", "def f")]
    after = scrape(gateway.url)

    def delta(name: str, labels: tuple[Any, ...] = ()) -> float:
        return after[name].get(labels, 0.0) - before.get(name, {}).get(labels, 0.0)

    generated = sum(r.usage.completion_tokens for r in replies if r.usage is not None)
    assert delta("specdec_gateway_generated_tokens_total") == generated
    calls = sum((r.model_extra or {})["specdec"]["verify_calls"] for r in replies)
    assert delta("specdec_gateway_verify_calls_total") == calls
    assert delta("specdec_gateway_verify_round_trip_seconds_count") == calls
    route = (("method", "POST"), ("route", "/v1/chat/completions"), ("status", "200"))
    assert delta("specdec_gateway_requests_total", route) == 2
    drafted = after["specdec_gateway_drafted_tokens_total"][()]
    accepted = after["specdec_gateway_accepted_tokens_total"][()]
    assert after["specdec_gateway_acceptance_rate"][()] == pytest.approx(accepted / drafted)
    first = after["specdec_gateway_per_position_acceptance"][(("position", "1"),)]
    assert first == pytest.approx(after["specdec_gateway_accepted_at_position_total"][
        (("position", "1"),)] / after["specdec_gateway_drafts_total"][()])


def test_gateway_api_key_and_verifier_down(tiny_models: dict[str, Path]) -> None:
    with LiveServer(fp32_settings(tiny_models["gpt2-target"])) as verifier:
        client = SpecDecClient(verifier.url, "ngram", retry_budget_s=1.0)
    # the verifier is gone now: the gateway answers 503 in OpenAI's shape
    settings = GatewaySettings(MODEL, api_key="sesame")
    with ThreadedServer(create_gateway(client, settings)) as gw:
        denied = openai.OpenAI(base_url=gw.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            denied.models.list()
        assert httpx.get(gw.url + "/metrics").status_code == 401
        allowed = openai.OpenAI(base_url=gw.url + "/v1", api_key="sesame", max_retries=0)
        with pytest.raises(openai.InternalServerError) as info:
            allowed.completions.create(model=MODEL, prompt="the cat", max_tokens=4)
        assert info.value.status_code == 503
        assert error_of(info.value)["code"] == "verifier_unavailable"
        assert httpx.get(gw.url + "/health").json() == {"status": "ok"}  # names nothing
        # Under the key the API docs are off and the schema needs the key (docs/deploy.md).
        for path in ("/docs", "/redoc"):
            assert httpx.get(gw.url + path).status_code == 404, path
        assert httpx.get(gw.url + "/openapi.json").status_code == 401
        schema = httpx.get(gw.url + "/openapi.json", headers={"authorization": "Bearer sesame"})
        assert schema.status_code == 200 and "/v1/chat/completions" in schema.json()["paths"]


def test_a_client_that_hangs_up_stops_its_generation(gateway: ThreadedServer,
                                                     gpt2_server: LiveServer) -> None:
    """The stream is cut after its first chunk: the generation ends at its next block and its
    verifier session is closed (not left to expire)."""
    body = {"model": MODEL, "prompt": "the cat", "max_tokens": 200, "temperature": 0,
            "stream": True}
    with httpx.Client(timeout=30) as http, http.stream(
            "POST", gateway.url + "/v1/completions", json=body) as response:
        assert response.status_code == 200
        next(response.iter_lines())
    wait_for_idle(gateway.url, gpt2_server.url)
    generated = scrape(gateway.url)["specdec_gateway_generated_tokens_total"][()]
    assert generated > 0


def test_the_grafana_dashboard_uses_metrics_that_exist(gateway: ThreadedServer,
                                                       gpt2_server: LiveServer,
                                                       oai: openai.OpenAI) -> None:
    dashboard = orjson.loads((ROOT / "deploy/grafana/specdec.json").read_bytes())
    # labelled series appear with their first value: one generation through the gateway (so
    # drafts are accepted at some position, whatever ran before this test) and one error
    # answer on the verifier
    oai.completions.create(model=MODEL, prompt="the dog ran to", temperature=0, max_tokens=16)
    httpx.post(gpt2_server.url + "/v1/sessions/none/verify", json={"position": 1,
                                                                   "last_token": 0,
                                                                   "final_uniform": 0.5})
    used = {name for panel in dashboard["panels"] for target in panel["targets"]
            for name in re.findall(r"specdec_[a-z_]+", target["expr"])}
    exported = set(scrape(gateway.url)) | set(scrape(gpt2_server.url))
    assert used and used <= exported, used - exported
