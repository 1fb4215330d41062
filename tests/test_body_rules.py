"""One set of rules for every JSON body (``verifier_service/json_route.py``, issue #56): create,
generate and verify classify a body alike - its content type, JSON that does not decode, its
shape - in the same error body, and a refused call runs nothing: no job, no session opened,
the verify call's session where it was. (The verify call once had an entrance of its own, with
its own content-type and JSON rules: ``text/plain;json`` ran a verify step where create
answered 422, NaN was 422 on create and 400 on verify, a UTF-16 body was served by create.)"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest

from shared.protocol.schema import VerifyResponse
from tests.support.live_server import LiveServer

VERIFY = "/v1/sessions/{session_id}/verify"
GOOD = {  # one good body per route
    "create": {"prompt_ids": [2, 3, 4]},
    "generate": {"prompt_ids": [2, 3, 4], "max_new_tokens": 2},
    "verify": {"position": 3, "last_token": 4, "draft_ids": [5, 6],
               "log_uniforms": [-0.1, -0.2], "final_uniform": 0.5},
}
# After a refused verify: a call with other drafts at the same position. Had the refused call
# run its step, this one would get 409 step_conflict.
OTHER_VERIFY = {**GOOD["verify"], "draft_ids": [7, 8]}
JSON = {"content-type": "application/json"}


def with_key(value: bytes) -> Callable[[bytes], bytes]:
    """The good body with one more key, ``"zz": <value>`` (raw bytes, as sent)."""
    return lambda body: body[:-1] + b', "zz": ' + value + b"}"


def same(body: bytes) -> bytes:
    return body


# (case, the good body -> the body sent, headers, status, code)
REFUSED: list[tuple[str, Callable[[bytes], bytes], dict[str, str], int, str]] = [
    ("text/plain;json", same, {"content-type": "text/plain;json"}, 415,
     "unsupported_media_type"),
    ("problem+json", same, {"content-type": "application/problem+json"}, 415,
     "unsupported_media_type"),
    ("charset utf-16", same, {"content-type": "application/json; charset=utf-16"}, 415,
     "unsupported_media_type"),
    ("NaN", with_key(b"NaN"), JSON, 400, "invalid_json"),
    ("-Infinity", with_key(b"-Infinity"), JSON, 400, "invalid_json"),
    ("beyond a double", with_key(b"1e400"), JSON, 400, "invalid_json"),
    ("lone surrogate", with_key(b'"\\ud800"'), JSON, 400, "invalid_json"),
    ("invalid UTF-8", with_key(b'"\xff"'), JSON, 400, "invalid_json"),
    ("UTF-16 with BOM", lambda body: body.decode().encode("utf-16"), JSON, 400, "invalid_json"),
    ("UTF-16-LE", lambda body: body.decode().encode("utf-16-le"), JSON, 400, "invalid_json"),
    ("UTF-8 BOM", lambda body: b"\xef\xbb\xbf" + body, JSON, 400, "invalid_json"),
    ("syntax", lambda body: b"{not json", JSON, 400, "invalid_json"),
    ("too deep", lambda body: b"[" * 2000 + b"]" * 2000, JSON, 400, "invalid_json"),
]


@pytest.fixture()
def http(llama_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=llama_server.url, timeout=30) as client:
        yield client


def new_session(http: httpx.Client) -> str:
    created = http.post("/v1/sessions", json=GOOD["create"])
    assert created.status_code == 200, created.text
    return created.json()["session_id"]  # type: ignore[no-any-return]


def work_done(http: httpx.Client) -> tuple[int, int, int]:
    """(jobs run, sessions open, verify calls) so far."""
    stats = http.get("/v1/metrics").json()
    return stats["jobs"], stats["sessions"], stats["verify_calls"]


def send(http: httpx.Client, route: str, body: bytes, headers: dict[str, str],
         session_id: str = "") -> httpx.Response:
    path = {"create": "/v1/sessions", "generate": "/v1/generate",
            "verify": VERIFY.format(session_id=session_id)}[route]
    return http.post(path, content=body, headers=headers)


def gist(message: str) -> str:
    """An error message without where in the body it found the problem (bodies differ)."""
    return message.split(" at ")[0]


@pytest.mark.parametrize(("case", "make", "headers", "status", "code"), REFUSED,
                         ids=[case[0] for case in REFUSED])
def test_every_route_refuses_a_body_alike_and_runs_nothing(
        http: httpx.Client, case: str, make: Callable[[bytes], bytes], headers: dict[str, str],
        status: int, code: str) -> None:
    sid = new_session(http)
    errors: dict[str, dict[str, Any]] = {}
    for route in ("create", "generate", "verify"):
        before = work_done(http)
        response = send(http, route, make(orjson.dumps(GOOD[route])), headers, sid)
        assert response.status_code == status, (route, response.text)
        assert work_done(http) == before, route  # no job, no session, no verify call
        errors[route] = response.json()["error"]
        assert set(errors[route]) == {"code", "message", "field"}, errors[route]
    shapes = {(e["code"], e["field"], gist(e["message"])) for e in errors.values()}
    assert len(shapes) == 1, errors
    assert errors["verify"]["code"] == code and errors["verify"]["field"] == "body"
    if status == 415:
        assert "content-type: application/json" in errors["verify"]["message"]
    else:
        assert errors["verify"]["message"].startswith("the body is not valid JSON: ")
    # The verify call's session is where it was: a call with other drafts runs its step.
    ok = http.post(VERIFY.format(session_id=sid), json=OTHER_VERIFY)
    assert ok.status_code == 200, ok.text
    assert ok.json()["position"] == 3 + ok.json()["num_accepted"] + 1


def test_the_media_type_is_matched_without_case(http: httpx.Client) -> None:
    """``APPLICATION/JSON; charset=UTF-8`` is application/json (media types and charsets are
    case-insensitive): served on every route."""
    headers = {"content-type": "APPLICATION/JSON; charset=UTF-8"}
    sid = new_session(http)
    for route in ("create", "generate", "verify"):
        response = send(http, route, orjson.dumps(GOOD[route]), headers, sid)
        assert response.status_code == 200, (route, response.text)


def test_a_json_error_says_where(http: httpx.Client) -> None:
    """The message quotes the body around the place the decoder stopped, so it names the
    field a NaN was sent for."""
    body = orjson.dumps(GOOD["verify"])[:-1] + b', "draft_logprobs": [NaN, -0.5]}'
    response = send(http, "verify", body, JSON, new_session(http))
    assert response.status_code == 400
    assert "draft_logprobs" in response.json()["error"]["message"]


# -- kept from test_fast_verify.py: good calls and the OpenAPI document ---------------------------
@pytest.mark.parametrize("body", [
    GOOD["verify"],
    {**GOOD["verify"], "draft_ids": [], "log_uniforms": []},
    {**GOOD["verify"], "draft_logprobs": [-0.5, -0.7]},
    {**GOOD["verify"], "return_top_ids": 3},
    {**GOOD["verify"], "tree_parents": [-1, -1]},
    {**GOOD["verify"], "draft_ids": [], "log_uniforms": [], "more_uniforms": [0.3, 0.6]},
])
def test_good_verify_replies_fit_the_schema(http: httpx.Client, body: dict[str, Any]) -> None:
    """The route writes its reply without FastAPI's check against ``response_model``: it must
    still be a VerifyResponse, and the same call again gets the same reply."""
    sid = new_session(http)
    first = send(http, "verify", orjson.dumps(body), JSON, sid)
    assert first.status_code == 200, first.text
    assert first.headers["content-type"] == "application/json"
    VerifyResponse.model_validate(first.json())
    again = send(http, "verify", orjson.dumps(body), JSON, sid)
    assert again.json() == first.json()


def test_unknown_session_and_wrong_method(http: httpx.Client) -> None:
    response = send(http, "verify", orjson.dumps(GOOD["verify"]), JSON, "no-such-session")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "session_not_found"
    response = http.get(VERIFY.format(session_id="x"))
    assert response.status_code == 405
    assert response.json()["error"]["code"] == "method_not_allowed"


def test_the_openapi_document_describes_the_json_routes(http: httpx.Client) -> None:
    """schemathesis (tests/test_fuzz.py) fuzzes the routes from this document."""
    paths = http.get("/openapi.json").json()["paths"]
    for path, request, reply in [
            ("/v1/sessions/{session_id}/verify", "VerifyRequest", "VerifyResponse"),
            ("/v1/sessions", "CreateSessionRequest", "CreateSessionResponse"),
            ("/v1/generate", "GenerateRequest", "GenerateResponse")]:
        post = paths[path]["post"]
        body = post["requestBody"]
        assert body["required"] is True
        assert body["content"]["application/json"]["schema"]["$ref"].endswith("/" + request)
        assert post["responses"]["200"]["content"]["application/json"]["schema"][
            "$ref"].endswith("/" + reply)
        for status in ("400", "415", "422"):
            assert post["responses"][status]["content"]["application/json"]["schema"][
                "$ref"].endswith("/ErrorResponse")
