"""The client side of ``python -m scripts.bench calls``: sessions that send verify calls as fast
as the verifier answers them, in a process of their own. Only light imports here: each client
process is spawned, and imports this module (and the entry point's), not torch."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import orjson


async def _session_loop(http: httpx.AsyncClient, k: int, vocab: int, stop_at: float) -> int:
    prompt = [(i * 37) % vocab for i in range(16)]
    created = orjson.loads((await http.post("/v1/sessions", content=orjson.dumps(
        {"prompt_ids": prompt}), headers={"content-type": "application/json"})).content)
    sid, position, last, calls = created["session_id"], created["position"], prompt[-1], 0
    while time.perf_counter() < stop_at:
        body = {"position": position, "last_token": last,
                "draft_ids": [(position + i) % vocab for i in range(k)],
                "log_uniforms": [-0.5] * k, "final_uniform": 0.5}
        reply = await http.post(f"/v1/sessions/{sid}/verify", content=orjson.dumps(body),
                                headers={"content-type": "application/json"})
        if reply.status_code != 200:
            raise RuntimeError(f"verify: {reply.status_code} {reply.text[:200]}")
        answer = orjson.loads(reply.content)
        position, last = answer["position"], answer["next_token"]
        calls += 1
        if position > 3000:  # stay inside the slot: a new session
            await http.delete(f"/v1/sessions/{sid}")
            return calls + await _session_loop(http, k, vocab, stop_at)
    await http.delete(f"/v1/sessions/{sid}")
    return calls


def client_process(url: str, sessions: int, k: int, vocab: int, seconds: float, ready: Any,
                    go: Any, out: Any) -> None:
    async def main() -> int:
        limits = httpx.Limits(max_connections=sessions, max_keepalive_connections=sessions)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as http:
            await http.get("/healthz")
            ready.put(True)
            await asyncio.get_running_loop().run_in_executor(None, go.wait)
            stop_at = time.perf_counter() + seconds
            done = await asyncio.gather(*(_session_loop(http, k, vocab, stop_at)
                                          for _ in range(sessions)))
            return sum(done)

    started = time.process_time()
    calls = asyncio.run(main())
    out.put((calls, time.process_time() - started))
