"""The gateway is closed to other sites by default (issue #57): a body that is not JSON gets 415
before anything is generated (a page anywhere can send a form or ``text/plain`` without asking),
a Host the gateway does not answer to gets 421 (DNS rebinding), CORS headers go only to the
origins configured, and ``specdec serve`` takes its key from a file or the environment, never
from argv. Also: request fields that would change the answer and are not implemented are 400s.
A real browser against the same gateway: tests/test_playground.py."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from drafter_client.api import SpecDecClient
from drafter_client.apps.cli import build_parser, client_settings, run, serve_api_key
from drafter_client.gateway import GatewaySettings, create_gateway
from shared.http.cross_site import HostPolicy, json_body_problem
from tests.support.live_server import LiveServer
from tests.support.prometheus import scrape
from tests.support.servers import ThreadedServer

MODEL = "tiny-gpt2"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "the cat"}], "max_tokens": 2,
        "temperature": 0}
COMPLETION = {"model": MODEL, "prompt": "the cat", "max_tokens": 2, "temperature": 0}
BODIES = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION}


@pytest.fixture(scope="module")
def client(gpt2_server: LiveServer, tiny_models: dict[str, Path]) -> SpecDecClient:
    return SpecDecClient(gpt2_server.url, "ngram", tokenizer=str(tiny_models["gpt2-drafter"]))


@contextlib.contextmanager
def serving(client: SpecDecClient, **settings: Any) -> Iterator[ThreadedServer]:
    with ThreadedServer(create_gateway(client, GatewaySettings(MODEL, **settings))) as server:
        yield server


@pytest.fixture(scope="module")
def gateway(client: SpecDecClient) -> Iterator[ThreadedServer]:
    """Bound to 127.0.0.1, no key, nothing configured: the default."""
    with serving(client) as server:
        yield server


def work(gateway: ThreadedServer, verifier: LiveServer) -> tuple[float, float, int]:
    """What generating leaves behind: the gateway's prompt and generated tokens, and the
    verifier's verify calls plus prefilled tokens."""
    samples = scrape(gateway.url)
    verifier_metrics = httpx.get(verifier.url + "/v1/metrics").json()
    return (samples["specdec_gateway_prompt_tokens_total"][()],
            samples["specdec_gateway_generated_tokens_total"][()],
            verifier_metrics["verify_calls"] + verifier_metrics["prefill_tokens"])


def error_of(response: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# -- 415: only JSON bodies -----------------------------------------------------------------

# What a page on another site can send without a preflight: each carries a valid request.
SIMPLE = {
    "text/plain": lambda body: {"content": orjson.dumps(body),
                                "headers": {"content-type": "text/plain;charset=UTF-8"}},
    "form": lambda body: {"data": {orjson.dumps(body).decode(): ""}},
    "multipart": lambda body: {"files": {"body": ("b.json", orjson.dumps(body),
                                                  "application/json")}},
    "none": lambda body: {"content": orjson.dumps(body)},  # fetch() of a Blob without a type
}


@pytest.mark.parametrize("kind", list(SIMPLE))
@pytest.mark.parametrize("path", list(BODIES))
def test_a_body_that_is_not_json_gets_415_and_nothing_runs(
        gateway: ThreadedServer, gpt2_server: LiveServer, path: str, kind: str) -> None:
    before = work(gateway, gpt2_server)
    answer = httpx.post(gateway.url + path, timeout=30, **SIMPLE[kind](BODIES[path]))
    assert answer.status_code == 415, answer.text
    error = error_of(answer)
    assert error["code"] == "unsupported_media_type"
    assert "application/json" in error["message"]
    named = {"text/plain": "'text/plain'", "form": "'application/x-www-form-urlencoded'",
             "multipart": "'multipart/form-data'", "none": "no Content-Type"}[kind]
    assert named in error["message"], error["message"]
    assert work(gateway, gpt2_server) == before  # nothing tokenized, drafted or verified


@pytest.mark.parametrize("path", list(BODIES))
def test_the_same_body_as_json_is_answered(gateway: ThreadedServer, path: str) -> None:
    """Negative control: what the 415s refused is a valid request."""
    for content_type in ("application/json", "application/json; charset=utf-8",
                         "Application/JSON;charset=\"UTF-8\""):
        answer = httpx.post(gateway.url + path, content=orjson.dumps(BODIES[path]), timeout=60,
                            headers={"content-type": content_type})
        assert answer.status_code == 200, (content_type, answer.text)


def test_json_in_another_charset_is_refused() -> None:
    assert json_body_problem("application/json; charset=utf-16") is not None
    assert json_body_problem("application/json-seq") is not None
    assert json_body_problem("application/json") is None


# -- 421: the Host it answers to -----------------------------------------------------------

def chat_with_host(gateway: ThreadedServer, host: str) -> httpx.Response:
    return httpx.post(gateway.url + "/v1/chat/completions", json=CHAT, timeout=60,
                      headers={"host": host})


@pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "127.0.0.1.nip.io:{port}",
                                  "127.0.0.1:1", "localhost:{other}", "bad host", "[::2]:{port}"])
def test_a_foreign_host_gets_421_and_nothing_runs(gateway: ThreadedServer,
                                                  gpt2_server: LiveServer, host: str) -> None:
    host = host.format(port=gateway.port, other=gateway.port + 1)
    before = work(gateway, gpt2_server)
    answer = chat_with_host(gateway, host)
    assert answer.status_code == 421, answer.text
    error = error_of(answer)
    assert error["code"] == "host_not_allowed"
    assert "--allowed-hosts" in error["message"] and "DNS rebinding" in error["message"]
    assert work(gateway, gpt2_server) == before
    # every route, the playground's page included
    page = httpx.get(gateway.url + "/", headers={"host": host})
    assert page.status_code == 421


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "LOCALHOST:{port}",
                                  "[::1]:{port}", "localhost.:{port}"])
def test_the_loopback_names_on_its_port_are_answered(gateway: ThreadedServer, host: str) -> None:
    answer = chat_with_host(gateway, host.format(port=gateway.port))
    assert answer.status_code == 200, answer.text


def test_an_allow_list_adds_names(client: SpecDecClient) -> None:
    with serving(client, allowed_hosts=("api.example", "other.example:8443")) as gw:
        assert chat_with_host(gw, "api.example:1234").status_code == 200
        assert chat_with_host(gw, "api.example").status_code == 200
        assert chat_with_host(gw, "other.example:8443").status_code == 200
        assert chat_with_host(gw, "other.example:8444").status_code == 421
        assert chat_with_host(gw, "evil.example").status_code == 421
        assert chat_with_host(gw, f"127.0.0.1:{gw.port}").status_code == 200


def test_bound_to_every_interface_any_host_unless_listed(client: SpecDecClient) -> None:
    with serving(client, host="0.0.0.0") as gw:
        assert chat_with_host(gw, "gateway.lan:8080").status_code == 200
    with serving(client, host="0.0.0.0", allowed_hosts=("gateway.lan",)) as gw:
        assert chat_with_host(gw, "gateway.lan:8080").status_code == 200
        assert chat_with_host(gw, "evil.example:8080").status_code == 421
        assert httpx.get(gw.url + "/health").status_code == 200  # a probe on 127.0.0.1
    with serving(client, allowed_hosts=("*",)) as gw:
        assert chat_with_host(gw, "anything.example").status_code == 200


def test_the_host_policy() -> None:
    loopback = HostPolicy("127.0.0.1")
    assert loopback.allows("localhost:8080", 8080) and loopback.allows(None, 8080)
    assert not loopback.allows("localhost:8081", 8080)
    assert loopback.allows("localhost", 80) and not loopback.allows("localhost", 8080)
    assert not loopback.allows("", 8080) and not loopback.allows("a:b:c", 8080)
    assert not loopback.allows("[::1", 8080) and not loopback.allows("[zz::1]:8080", 8080)
    named = HostPolicy("10.0.0.5")
    assert named.allows("10.0.0.5:8080", 8080) and not named.allows("10.0.0.6:8080", 8080)
    assert HostPolicy("::1").allows("[::1]:8080", 8080)
    assert HostPolicy("::").allows("evil.example", 8080)  # every interface, no list
    assert not HostPolicy("::", ["api.example"]).allows("evil.example", 8080)


# -- CORS only where configured ------------------------------------------------------------

ORIGIN = "http://app.example:3000"


def preflight(gateway: ThreadedServer, origin: str) -> httpx.Response:
    return httpx.options(gateway.url + "/v1/chat/completions", headers={
        "origin": origin, "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type"})


def test_no_cors_headers_by_default(gateway: ThreadedServer) -> None:
    simple = httpx.get(gateway.url + "/v1/models", headers={"origin": ORIGIN})
    assert simple.status_code == 200
    assert not [h for h in simple.headers if h.startswith("access-control-")]
    answer = preflight(gateway, ORIGIN)
    assert answer.status_code != 200
    assert not [h for h in answer.headers if h.startswith("access-control-")]
    posted = httpx.post(gateway.url + "/v1/chat/completions", json=CHAT, timeout=60,
                        headers={"origin": ORIGIN})
    assert "access-control-allow-origin" not in posted.headers


def test_cors_for_the_configured_origins_only(client: SpecDecClient) -> None:
    with serving(client, cors_origins=(ORIGIN,)) as gw:
        allowed = preflight(gw, ORIGIN)
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in allowed.headers["access-control-allow-methods"]
        assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
        posted = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=60,
                            headers={"origin": ORIGIN})
        assert posted.status_code == 200
        assert posted.headers["access-control-allow-origin"] == ORIGIN
        for other in ("http://evil.example", "http://app.example:3001", "null"):
            refused = preflight(gw, other)
            assert "access-control-allow-origin" not in refused.headers, other
            simple = httpx.get(gw.url + "/v1/models", headers={"origin": other})
            assert "access-control-allow-origin" not in simple.headers, other
        # the content type still holds: a simple request from the allowed origin
        plain = httpx.post(gw.url + "/v1/chat/completions", content=orjson.dumps(CHAT),
                           headers={"origin": ORIGIN, "content-type": "text/plain"})
        assert plain.status_code == 415


# -- the key never on the command line -----------------------------------------------------

URL = ["--verifier-url", "http://127.0.0.1:9"]


def run_cli(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = run(argv)
    return code, err.getvalue()


@pytest.mark.parametrize("flag", [["--serve-api-key", "s3cret"], ["--serve-api-key=s3cret"],
                                  ["--serve-api-k", "s3cret"], ["--serve-api", "s3cret"]])
def test_the_key_on_the_command_line_is_refused(flag: list[str]) -> None:
    code, err = run_cli(["serve", *URL, "--drafter", "ngram", *flag])
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "SPECDEC_SERVE_API_KEY" in err and "--serve-api-key-file" in err
    assert "s3cret" not in err


def test_the_key_comes_from_a_file_or_the_environment(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECDEC_SERVE_API_KEY", raising=False)
    monkeypatch.delenv("SPECDEC_SERVE_API_KEY_FILE", raising=False)
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")

    def parse(argv: list[str]) -> Any:  # a parser per call: defaults read the environment
        return build_parser().parse_args(argv)

    args = parse(["serve", *URL, "--drafter", "ngram", "--serve-api-key-file", str(key_file)])
    assert client_settings(args).gateway.api_key == "s3cret"
    assert serve_api_key(parse(["serve", *URL, "--drafter", "ngram"])) is None  # open
    monkeypatch.setenv("SPECDEC_SERVE_API_KEY", "from-env")
    assert serve_api_key(parse(["serve", *URL, "--drafter", "ngram"])) == "from-env"
    with pytest.raises(ValueError, match="given twice"):
        serve_api_key(args)
    monkeypatch.setenv("SPECDEC_SERVE_API_KEY", "")  # compose passes "" when unset
    assert serve_api_key(args) == "s3cret"
    monkeypatch.setenv("SPECDEC_SERVE_API_KEY_FILE", str(key_file))  # read when parsing
    assert serve_api_key(parse(["serve", *URL, "--drafter", "ngram"])) == "s3cret"


@pytest.mark.parametrize(("flags", "said"), [
    (["--serve-api-key-file", "/nonexistent/key"], "No such file"),
    (["--serve-api-key-file", "EMPTY"], "is empty"),
    (["--allowed-hosts", "http://api.example/"], "--allowed-hosts"),
    (["--cors-origins", "https://app.example/"], "--cors-origins"),
    (["--cors-origins", "app.example"], "--cors-origins"),
])
def test_bad_serve_flags_are_one_line(tmp_path: Path, flags: list[str], said: str) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    flags = [str(empty) if flag == "EMPTY" else flag for flag in flags]
    code, err = run_cli(["serve", *URL, "--drafter", "ngram", *flags])
    assert code == 2 and err.count("\n") == 1 and said in err, err


def test_the_lists_land_in_the_settings() -> None:
    args = build_parser().parse_args(["serve", *URL, "--drafter", "ngram", "--allowed-hosts",
                                      "api.example, [::1]:8080", "--cors-origins",
                                      "https://a.example,http://localhost:3000"])
    gateway = client_settings(args).gateway
    assert gateway.allowed_hosts == ("api.example", "[::1]:8080")
    assert gateway.cors_origins == ("https://a.example", "http://localhost:3000")


def test_the_serve_flag_checks_load_no_server() -> None:
    """The new flags are checked before torch, transformers or the gateway's app load."""
    code = ("import sys; from drafter_client.apps.cli import build_parser, _check_arguments; "
            "print(_check_arguments(build_parser().parse_args(['serve', '--verifier-url', 'u', "
            "'--drafter', 'd', '--allowed-hosts', 'a.example', '--cors-origins', "
            "'https://b.example']))); "
            "print(sorted(m for m in ('torch', 'transformers', 'fastapi') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.split() == ["None", "[]"]


def test_no_script_or_doc_passes_the_key_on_the_command_line() -> None:
    root = Path(__file__).resolve().parents[1]
    # the files that pass it only to see it refused: this test and the attack bench's class
    refusing = {Path(__file__), root / "scripts" / "bench" / "attack_round4.py"}
    for folder in ("scripts", "benchmarks", "docs", "tests", "deploy"):
        for path in (root / folder).rglob("*"):
            if path.suffix in (".py", ".md", ".yml", ".sh") and path not in refusing:
                text = path.read_text(errors="replace")
                assert '"--serve-api-key",' not in text, path
                assert "--serve-api-key KEY" not in text and "--serve-api-key s" not in text, path
    assert "--serve-api-key" not in (root / "docker-compose.yml").read_text()


# -- fields not implemented, or malformed, are 400s ----------------------------------------

@pytest.mark.parametrize(("extra", "param"), [
    ({"prediction": {"type": "content", "content": 3}}, "prediction.content"),
    ({"prediction": "the cat"}, "prediction"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
])
def test_unsupported_or_malformed_fields_get_a_400_naming_them(gateway: ThreadedServer,
                                                  gpt2_server: LiveServer,
                                                  extra: dict[str, Any], param: str) -> None:
    before = work(gateway, gpt2_server)
    answer = httpx.post(gateway.url + "/v1/chat/completions", json={**CHAT, **extra}, timeout=60)
    assert answer.status_code == 400, answer.text
    assert error_of(answer)["param"] == param
    assert work(gateway, gpt2_server) == before


def test_fields_clients_commonly_send_are_still_accepted(gateway: ThreadedServer) -> None:
    common = {"user": "u1", "store": False, "metadata": {"k": "v"}, "parallel_tool_calls": True,
              "tool_choice": "none", "service_tier": "auto", "modalities": ["text"],
              "prediction": None, "functions": [], "logprobs": False, "n": 1,
              "reasoning_effort": "low", "stream_options": None}
    answer = httpx.post(gateway.url + "/v1/chat/completions", json={**CHAT, **common},
                        timeout=60)
    assert answer.status_code == 200, answer.text
