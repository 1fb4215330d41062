"""The lean verify endpoint (verifier_service/fast_verify.py) answers exactly as the FastAPI
route it shadows: two verifiers on one loaded target, one with the lean route and one without,
get the same calls; status, error code, field and (for good calls) the reply must match."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tests.support.live_server import fp32_settings
from tests.support.servers import ThreadedServer
from verifier_service import fast_verify
from verifier_service.app import create_app, server_options
from verifier_service.fast_verify import VERIFY_PATH
from verifier_service.settings import load_engine

JSON = {"content-type": "application/json"}
GOOD = {"position": 3, "last_token": 4, "draft_ids": [5, 6], "log_uniforms": [-0.1, -0.2],
        "final_uniform": 0.5}


@pytest.fixture(scope="module")
def pair(tiny_models: dict[str, Path]) -> Iterator[tuple[httpx.Client, httpx.Client]]:
    settings = fp32_settings(tiny_models["llama-target"], max_draft_tokens=8, max_context=64)
    runner = load_engine(settings)
    lean_app = create_app(settings, runner)
    full_app = create_app(settings, runner)
    full_app.router.routes[:] = [r for r in full_app.router.routes
                                 if getattr(r, "endpoint", None) is not fast_verify.verify]
    assert len(full_app.router.routes) == len(lean_app.router.routes) - 1
    with ThreadedServer(lean_app, **server_options(settings)) as lean, \
            ThreadedServer(full_app, **server_options(settings)) as full, \
            httpx.Client(base_url=lean.url, timeout=30) as a, \
            httpx.Client(base_url=full.url, timeout=30) as b:
        yield a, b


def both(pair: tuple[httpx.Client, httpx.Client], body: bytes, headers: dict[str, str],
         session: bool = True) -> tuple[httpx.Response, httpx.Response]:
    answers = []
    for http in pair:
        sid = "no-such-session"
        if session:
            created = http.post("/v1/sessions", json={"prompt_ids": [2, 3, 4]})
            assert created.status_code == 200, created.text
            sid = created.json()["session_id"]
        answers.append(http.post(VERIFY_PATH.format(session_id=sid), content=body,
                                 headers=headers))
    return answers[0], answers[1]


def dump(body: object) -> bytes:
    return orjson.dumps(body)


@pytest.mark.parametrize(("body", "headers"), [
    (dump(GOOD), JSON),
    (dump({**GOOD, "draft_ids": [], "log_uniforms": []}), JSON),
    (dump({**GOOD, "draft_logprobs": [-0.5, -0.7]}), JSON),
    (dump({**GOOD, "return_top_ids": 3}), JSON),
    (dump({**GOOD, "tree_parents": [-1, -1]}), JSON),
    (dump({**GOOD, "draft_ids": [5, 64]}), JSON),  # outside the vocabulary: the validator's
    (dump({**GOOD, "position": 7}), JSON),  # 409 with the session's position
    (dump({**GOOD, "draft_ids": "abc"}), JSON),
    (dump({**GOOD, "surprise": 1}), JSON),
    (dump({**GOOD, "final_uniform": 1.5, "log_uniforms": [0.5, 0.1]}), JSON),  # two problems
    (dump({k: v for k, v in GOOD.items() if k != "position"}), JSON),
    (dump([1, 2]), JSON),
    (dump(None), JSON),
    (b"", JSON),
    (b"{not json", JSON),
    (b"\xff\xfe", JSON),
    (dump(GOOD), {"content-type": "text/plain"}),
    (dump(GOOD), {}),
])
def test_lean_route_answers_as_fastapi(pair: tuple[httpx.Client, httpx.Client], body: bytes,
                                       headers: dict[str, str]) -> None:
    lean, full = both(pair, body, headers)
    assert lean.status_code == full.status_code, (lean.text, full.text)
    if full.status_code == 200:
        a, b = lean.json(), full.json()
        a.pop("forward_ms"), b.pop("forward_ms")  # timings: the same fields, other values
        for load in (a.pop("load"), b.pop("load")):
            assert set(load) == {"sessions", "rows", "step_ms", "row_ms", "draft_price_ms"}
            assert load["sessions"] == 1 and load["draft_price_ms"] == 0.0
        assert a == b
        return
    a, b = lean.json()["error"], full.json()["error"]
    assert (a["code"], a["field"], a.get("position")) == (b["code"], b["field"],
                                                          b.get("position"))
    if a["code"] != "invalid_json":  # the JSON parsers word their complaints differently
        assert a["message"] == b["message"]


def test_unknown_session_and_wrong_method(pair: tuple[httpx.Client, httpx.Client]) -> None:
    lean, full = both(pair, dump(GOOD), JSON, session=False)
    assert lean.status_code == full.status_code == 404
    assert lean.json() == full.json()
    for http in pair:
        response = http.get(VERIFY_PATH.format(session_id="x"))
        assert response.status_code == 405 and response.json()["error"]["code"] == \
            "method_not_allowed"
