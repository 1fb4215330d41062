"""A plain run (``more_uniforms``) retried while it runs gets the whole run's answer, not its
first step and not a 409 (#57 finding 7: 10 of 10 retries were truncated or refused)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx

from tests.support.live_server import fp32_settings
from tests.support.servers import ThreadedServer
from verifier_service.app import create_app, server_options
from verifier_service.settings import load_engine

RUN = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]


def test_a_retry_during_a_plain_run_gets_the_whole_run(tiny_models: dict[str, Path]) -> None:
    settings = fp32_settings(tiny_models["gpt2-target"], max_draft_tokens=8)
    engine = load_engine(settings)
    first_step_done, retry_sent = threading.Event(), threading.Event()
    run = engine.run
    steps = 0

    def held_after_the_first_step(batch: Any) -> Any:  # model thread
        nonlocal steps
        results = run(batch)
        steps += 1
        if steps == 2:  # the create, then the run's first step: hold until the retry is in
            first_step_done.set()
            retry_sent.wait(timeout=30)
        return results

    engine.run = held_after_the_first_step  # type: ignore[method-assign]
    app = create_app(settings, engine)
    with ThreadedServer(app, **server_options(settings)) as server, \
            httpx.Client(base_url=server.url, timeout=60) as http:
        sid = http.post("/v1/sessions", json={"prompt_ids": [2, 3, 4]}).json()["session_id"]
        call = {"position": 3, "last_token": 4, "final_uniform": 0.5, "more_uniforms": RUN}
        answers: list[httpx.Response] = []
        original = threading.Thread(target=lambda: answers.append(
            http.post(f"/v1/sessions/{sid}/verify", json=call)))
        original.start()
        assert first_step_done.wait(timeout=30)
        retry = threading.Thread(target=lambda: answers.append(
            http.post(f"/v1/sessions/{sid}/verify", json=call)))
        retry.start()
        # the retry is in the verifier's hands (waiting on the run) before the run goes on
        joined = threading.Event()
        for _ in range(300):  # 3 s at most
            if joined.wait(0.01) or waiting_on_a_run(app):
                break
        retry_sent.set()
        original.join(timeout=60)
        retry.join(timeout=60)
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    assert answers[0].json() == answers[1].json()
    assert len(answers[0].json()["more_tokens"]) == len(RUN)


def waiting_on_a_run(app: Any) -> bool:
    """A second call joined the run in progress (it waits on the run's future)."""
    runs = getattr(app.state.verifier.jobs, "plain_runs", {})
    return any(waiters for waiters in runs.values())
