"""``attack --classes``, hardening round 5 (issue #74): the grammar findings, attacked on the
running servers (scripts/bench/attack_servers.py):

- ``grammar chain``: a Lark grammar of 4,000 rules each calling the next (77 KB; llguidance
  recurses along it and dies of SIGSEGV on an 8 MiB stack) on verifier A's ``/v1/generate``
  while a bystander's ``/v1/generate`` runs: the grammar a 4xx naming ``grammar``, the bystander
  served, the verifier alive;
- ``schema chain``: a chat whose JSON schema chains 1,000 definitions (under the 64 KiB schema
  limit; its check crashes llguidance on the check's stack): a 400 naming ``response_format``,
  the gateway alive;
- ``repeated grammar``: the same greedy chat under nested counted repeats (``(a{1,76}){1,76}``,
  past llguidance's lexer fuel for one step on a long enough walk) 3 times (10 without
  --quick): every answer the same (a grammar's state used to carry from one to the next);
- ``unspellable const``: a schema whose ``const`` this vocabulary cannot spell (``"é"``), plain
  and streamed: a 400 naming ``response_format``, never a 502 or an answer that does not parse;
- ``schema flood``: 4 senders post chats, each with a new 49 KB schema, for 2 s (10 s without
  --quick) while ``/health`` is probed: the median probe within 0.25 s (compiles held the event
  loop: worst 100 ms).
"""

from __future__ import annotations

import statistics
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx

from scripts.bench.attack_gateway import start_gateway
from scripts.bench.attack_servers import AUTH, KEY, Outcome, Servers, health_waits
from verifier_service.launch import VerifierProcess

CHAT = "/v1/chat/completions"
MESSAGE = [{"role": "user", "content": "the cat sat on"}]
NESTED_REPEATS = {"type": "string", "pattern": "^(a{1,76}){1,76}$"}


class GrammarPair:
    """A verifier and a gateway on a tiny GPT-2 over printable ASCII (a byte-level vocabulary
    llguidance reads; the shared servers' word-level one it cannot), started by the first
    class that asks (:func:`pair`) and stopped with the other servers."""

    def __init__(self, s: Servers) -> None:
        from tests.support.tiny_models import save_ascii

        folder = save_ascii(s.root / "ascii-target", seed=5)
        for name in ("grammar verifier", "grammar gateway"):
            s.logs[name] = s.root / f"{name.replace(' ', '-')}.log"
        self.verifier = VerifierProcess(
            ["--model", str(folder), "--dtype", "float32", "--max-context", "512",
             "--max-draft-tokens", "8"], log_path=s.logs["grammar verifier"])
        self.verifier.start()
        s.closers.append(self.stop_verifier)
        self.gateway, self.url = start_gateway(self.verifier.url, (
            "--drafter", "ngram", "--tokenizer", str(folder), "--threads", "1"),
            s.logs["grammar gateway"], env={"SPECDEC_SERVE_API_KEY": KEY})
        s.closers.append(self.stop_gateway)
        self.model = str(httpx.get(self.url + "/v1/models", headers=AUTH)
                         .json()["data"][0]["id"])

    def stop_verifier(self) -> None:
        self.verifier.stop()

    def stop_gateway(self) -> None:
        self.gateway.terminate()
        self.gateway.wait(30)


def pair(s: Servers) -> GrammarPair:
    if "grammar pair" not in s.shared:
        s.shared["grammar pair"] = GrammarPair(s)
    return s.shared["grammar pair"]  # type: ignore[no-any-return]


def chained_lark(rules: int) -> str:
    return "\n".join(["start: r0", *(f'r{i}: r{i + 1} "a"' for i in range(rules)),
                      f'r{rules}: "b"'])


def chat(s: Servers, schema: dict[str, Any], **extra: Any) -> httpx.Response:
    p = pair(s)
    return httpx.post(p.url + CHAT, headers=AUTH, timeout=120, json={
        "model": p.model, "messages": MESSAGE, "max_tokens": 24, "temperature": 0,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "attack", "schema": schema}}, **extra})


def field_of(reply: httpx.Response) -> str | None:
    try:
        error = reply.json()["error"]
    except (ValueError, KeyError, TypeError):
        return None
    return error.get("field") or error.get("param")


def alive(url: str, path: str) -> bool:
    try:
        return httpx.get(url + path, timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def grammar_chain(s: Servers) -> Outcome:
    import llguidance

    grammar = str(llguidance.LLMatcher.grammar_from_lark(chained_lark(4000)))
    url = pair(s).verifier.url
    statuses: Counter[str] = Counter()
    bystander: list[int] = []

    def ordinary() -> None:
        reply = httpx.post(url + "/v1/generate", timeout=120,
                           json={"prompt_ids": [40, 41, 42], "max_new_tokens": 16})
        bystander.append(reply.status_code)

    thread = threading.Thread(target=ordinary)
    thread.start()
    reply = httpx.post(url + "/v1/generate", timeout=120,
                       json={"prompt_ids": [40, 41, 42], "grammar": grammar})
    thread.join()
    statuses[f"grammar {reply.status_code}"] += 1
    statuses[f"bystander {bystander[0]}"] += 1
    return statuses, {"refused naming grammar": reply.status_code in (400, 422)
                      and field_of(reply) == "grammar",
                      "bystander served": bystander == [200],
                      "verifier alive": alive(url, "/readyz")}, {
        "grammar_kib": len(grammar) // 1024, "message": reply.text[:160]}


def schema_chain(s: Servers) -> Outcome:
    count = 1000
    defs: dict[str, Any] = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}}
                            for i in range(count)}
    defs[f"d{count}"] = {"type": "integer"}
    reply = chat(s, {"$defs": defs, "$ref": "#/$defs/d0"})
    after = httpx.post(pair(s).url + CHAT, headers=AUTH, timeout=120, json={
        "model": pair(s).model, "messages": MESSAGE, "max_tokens": 4})
    statuses = Counter([str(reply.status_code), f"after {after.status_code}"])
    return statuses, {"400 naming response_format": reply.status_code == 400
                      and field_of(reply) == "response_format",
                      "gateway serves on": after.status_code == 200}, {
        "message": reply.text[:160]}


def repeated_grammar(s: Servers) -> Outcome:
    from tests.support.tiny_models import build_ascii_tokenizer

    push = {str(build_ascii_tokenizer().convert_tokens_to_ids("a")): 100}  # walk the repeats
    answers = []
    for _ in range(3 if s.quick else 10):
        reply = chat(s, NESTED_REPEATS, max_tokens=200, logit_bias=push)
        answers.append((reply.status_code, reply.text if reply.status_code != 200 else
                        reply.json()["choices"][0]["message"]["content"]))
    statuses = Counter(str(status) for status, _ in answers)
    return statuses, {"every answer the same": len(set(answers)) == 1}, {
        "first": str(answers[0])[:120]}


def unspellable_const(s: Servers) -> Outcome:
    plain = chat(s, {"const": "\u00e9"})
    with httpx.stream("POST", pair(s).url + CHAT, headers=AUTH, timeout=120, json={
            "model": pair(s).model, "messages": MESSAGE, "max_tokens": 24, "stream": True,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "e", "schema": {"const": "\u00e9"}}}}) as streamed:
        events = streamed.read().decode("utf-8", "replace")
    statuses = Counter([str(plain.status_code), f"stream {streamed.status_code}"])
    stream_refused = (streamed.status_code == 400 or (
        streamed.status_code == 200 and "response_format" in events and "502" not in events))
    return statuses, {"400 naming response_format": plain.status_code == 400
                      and field_of(plain) == "response_format",
                      "stream refused, no 502": stream_refused}, {
        "message": plain.text[:160]}


def big_schema(nonce: int) -> dict[str, Any]:
    """About 49 KB of JSON schema, new for each ``nonce``."""
    names = [f"field_{nonce}_{i}" for i in range(1000)]
    return {"type": "object", "additionalProperties": False, "required": names,
            "properties": {name: {"type": "integer"} for name in names}}


def schema_flood(s: Servers) -> Outcome:
    p = pair(s)
    statuses: Counter[str] = Counter()
    refusals: list[str] = []
    stop, counting = threading.Event(), threading.Lock()
    nonces = iter(range(10**9))

    def send() -> None:
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                with counting:
                    nonce = next(nonces)
                reply = client.post(p.url + CHAT, headers=AUTH, json={
                    "model": p.model, "messages": MESSAGE, "max_tokens": 2,
                    "response_format": {"type": "json_schema", "json_schema": {
                        "name": "big", "schema": big_schema(nonce)}}})
                with counting:
                    statuses[str(reply.status_code)] += 1
                    if reply.status_code != 200 and not refusals:
                        refusals.append(reply.text[:160])

    threads = [threading.Thread(target=send) for _ in range(4)]
    for thread in threads:
        thread.start()
    waits = health_waits(p.url, 2.0 if s.quick else 10.0)
    stop.set()
    for thread in threads:
        thread.join()
    median = statistics.median(waits)
    answered = all(status == "200" or status.startswith("4") for status in statuses)
    return statuses, {"every answer 200 or 4xx": answered and bool(statuses),
                      "/health median under 0.25 s": median < 0.25}, {
        "schema_kib": len(str(big_schema(0))) // 1024,
        "health_median_ms": round(1e3 * median, 1), "health_max_ms": round(1e3 * max(waits)),
        "health_probes": len(waits), "refused": refusals[0] if refusals else "",
        "chats": sum(statuses.values()),
        "seconds_per_chat": round((2.0 if s.quick else 10.0) * 4 / max(sum(statuses.values()),
                                                                         1), 3)}


ROUND_5: dict[str, Callable[[Servers], Outcome]] = {
    "grammar chain": grammar_chain, "schema chain": schema_chain,
    "repeated grammar": repeated_grammar, "unspellable const": unspellable_const,
    "schema flood": schema_flood,
}
