"""Structured output: every row of a block masked to what the grammar allows after the tokens
before it (``shared/protocol/grammar.py``), on a tiny GPT-2 whose 97 ids are printable ASCII.

Greedy speculation equals the target alone under the same grammar (``/v1/generate``, the
grammar's state on the verifier) at every k, including blocks the schema's end cuts; every
answer parses and validates. The first two sampled tokens follow the constrained target (an
independent reference: the model's rows masked to the sets written out here), and a client that
masks every row of a block with its first row's mask (a grammar not advanced along the drafts)
must fail that test."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import numpy as np
import openai
import pytest
import torch

from drafter_client.api import SpecDecClient
from drafter_client.transport import SpecDecError
from shared.engines.drafter import LMDrafter
from shared.models.catalog import load_causal_lm
from shared.protocol.grammar import (
    Constraint,
    GrammarDeadEnd,
    GrammarError,
    json_schema_grammar,
    lark_grammar,
)
from shared.protocol.schema import RowMask
from tests.support.in_process import InProcessVerifier
from tests.support.live_server import LiveServer, fp32_settings
from tests.support.statistics import chi_square_p, reference_probs, sample_pairs
from tests.support.tiny_models import build_ascii_tokenizer
from tests.test_gateway import error_of
from verifier_service.scheduling import generate

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "pick": {"enum": ["red", "green", "blue"]},
                   "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "maxItems": 3}},
    "required": ["ok", "pick", "tags"], "additionalProperties": False,
}
PROMPT = "give me json:"


@pytest.fixture(scope="module")
def json_server(tiny_models: dict[str, Path]) -> Iterator[LiveServer]:
    with LiveServer(fp32_settings(tiny_models["json-target"], max_draft_tokens=8)) as server:
        yield server


@pytest.fixture(scope="module")
def client(json_server: LiveServer, tiny_models: dict[str, Path]) -> SpecDecClient:
    return SpecDecClient(json_server.url, str(tiny_models["json-drafter"]))


@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_constrained_speculation_equals_the_target_alone(client: SpecDecClient,
                                                                k: int) -> None:
    grammar = json_schema_grammar(SCHEMA)
    alone = client.baseline(PROMPT, max_new_tokens=120, temperature=0, grammar=grammar)
    spec = client.generate(PROMPT, num_draft_tokens=k, max_new_tokens=120, temperature=0,
                           grammar=grammar)
    assert spec.token_ids == alone.token_ids
    assert spec.finish_reason == "stop"  # the schema's end: only EOS is left
    jsonschema.validate(json.loads(spec.text), SCHEMA)
    # negative control: unconstrained, this model writes no JSON at all
    free = client.generate(PROMPT, num_draft_tokens=k, max_new_tokens=40, temperature=0)
    with pytest.raises(ValueError):
        json.loads(free.text)


def test_sampled_constrained_answers_all_validate(client: SpecDecClient) -> None:
    grammar = json_schema_grammar(SCHEMA)
    for seed in range(6):
        result = client.generate(PROMPT, num_draft_tokens=4, max_new_tokens=120,
                                 temperature=1.0, seed=seed, grammar=grammar)
        jsonschema.validate(json.loads(result.text), SCHEMA)


def test_schemas_the_engine_refuses_name_the_problem() -> None:
    with pytest.raises(ValueError, match="compile"):
        json_schema_grammar({"type": "nonsense"})
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"x": deep}}
    with pytest.raises(ValueError, match="deeper"):
        json_schema_grammar(deep)
    with pytest.raises(ValueError, match="larger"):
        json_schema_grammar({"enum": ["x" * 70000]})


def test_a_bad_mask_is_refused_by_the_verifier(json_server: LiveServer) -> None:
    from drafter_client.transport import HttpVerifier, VerifierHTTPError
    from shared.protocol.schema import CreateSessionRequest, VerifyRequest

    verifier = HttpVerifier(json_server.url)
    session = verifier.create_session(CreateSessionRequest(prompt_ids=[5, 6])).session_id
    nothing = RowMask.of(np.zeros(97, dtype=bool))
    for masks in ([nothing], [RowMask.of(np.ones(97, dtype=bool))] * 2):
        with pytest.raises(VerifierHTTPError) as info:
            verifier.verify(session, VerifyRequest(position=2, last_token=6, final_uniform=0.5,
                                                   masks=masks))
        assert info.value.field == "masks"
    ok = verifier.verify(session, VerifyRequest(position=2, last_token=6, final_uniform=0.5,
                                                masks=[RowMask.of(np.arange(97) == 40)]))
    assert ok.next_token == 40  # the only token the mask allows


def mask_decoders(json_server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The threads that decode row masks during a 2-draft verify with masks and a
    /v1/generate under a grammar."""
    from drafter_client.transport import HttpVerifier
    from shared.protocol.schema import CreateSessionRequest, VerifyRequest

    threads: list[str] = []
    decode = RowMask.keep

    def spy(self: RowMask, vocab_size: int) -> Any:
        threads.append(threading.current_thread().name)
        return decode(self, vocab_size)

    monkeypatch.setattr(RowMask, "keep", spy)
    verifier = HttpVerifier(json_server.url)
    session = verifier.create_session(CreateSessionRequest(prompt_ids=[5, 6])).session_id
    verifier.verify(session, VerifyRequest(
        position=2, last_token=6, draft_ids=[40, 41], log_uniforms=[-1.0, -1.0],
        final_uniform=0.5, masks=[RowMask.of(np.ones(97, dtype=bool))] * 3))
    response = httpx.post(f"{json_server.url}/v1/generate", json={
        "prompt_ids": [5, 6], "max_new_tokens": 3, "grammar": json_schema_grammar(SCHEMA)},
        timeout=60)
    assert response.status_code == 200, response.text
    return threads


def test_row_masks_are_decoded_before_the_batch_not_on_its_thread(
        json_server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A call's masks are its own work: decoded on a worker thread when it arrives, so a
    neighbour's block never waits for them (#75). Control: decoding left to the job (as it
    was) shows up on the model thread."""
    threads = mask_decoders(json_server, monkeypatch)
    assert len(threads) >= 3 + 1 and not [t for t in threads if t.startswith("model")], threads
    monkeypatch.setattr(generate, "decoded_masks", no_decoding)
    assert [t for t in mask_decoders(json_server, monkeypatch) if t.startswith("model")]


async def no_decoding(ctx: Any, scheduler: Any, req: Any) -> None:
    return None


# -- the sampled distribution ------------------------------------------------------------------

RUNS = 3000
CONTROL_RUNS = 250  # the wrong masks give pairs the grammar forbids: a count, not a p-value
LARK = 'start: ("a" | "b" | "c") ("d" | "e" | "a")'
FIRST, SECOND = "abc", "dea"
PARAMS: dict[str, Any] = {"temperature": 1.0}


@pytest.fixture(scope="module")
def in_process(tiny_models: dict[str, Path]) -> SpecDecClient:
    verifier = InProcessVerifier.load(fp32_settings(tiny_models["json-target"],
                                                    max_draft_tokens=8))
    return SpecDecClient(verifier, str(tiny_models["json-drafter"]), dtype="float32",
                         device="cpu")


def exact_constrained_pairs(client: SpecDecClient, model_dir: Path,
                            prompt: list[int]) -> dict[tuple[int, ...], float]:
    """P(first two tokens) of the target masked to FIRST then SECOND, without our code."""
    model = load_causal_lm(str(model_dir), torch.float32, torch.device("cpu"))
    first_ids = [client.tokenizer.convert_tokens_to_ids(c) for c in FIRST]
    second_ids = [client.tokenizer.convert_tokens_to_ids(c) for c in SECOND]

    def masked(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
        keep = torch.full_like(logits, float("-inf"))
        keep[..., ids] = 0.0
        return logits + keep

    with torch.no_grad():
        first = reference_probs(masked(model(torch.tensor([prompt])).logits[:, -1],
                                       first_ids), PARAMS)[0]
        batch = torch.tensor([[*prompt, t] for t in first_ids])
        second = reference_probs(masked(model(batch).logits[:, -1], second_ids), PARAMS)
    return {(t1, t2): float(first[t1] * second[row, t2])
            for row, t1 in enumerate(first_ids) for t2 in second_ids}


@pytest.mark.slow
def test_first_two_tokens_follow_the_constrained_target(in_process: SpecDecClient,
                                                        tiny_models: dict[str, Path]) -> None:
    prompt = in_process.encode(PROMPT)
    exact = exact_constrained_pairs(in_process, tiny_models["json-target"], prompt)
    counts = sample_pairs(in_process, {**PARAMS, "grammar": lark_grammar(LARK)}, RUNS,
                          prompt=prompt)
    assert set(counts) <= set(exact)  # nothing outside the grammar
    p_value, tv = chi_square_p(counts, exact)
    assert p_value > 1e-3, f"chi-square p = {p_value:.2e}, TV = {tv:.3f}"
    assert tv < 0.1, f"TV = {tv:.3f}"


@pytest.mark.slow
def test_negative_control_the_first_rows_mask_for_every_row(
        in_process: SpecDecClient, tiny_models: dict[str, Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A grammar not advanced along the drafts: every row gets row 0's mask (and the client
    takes whatever comes back). Must fail the same test."""
    def first_mask_only(self: Constraint, drafts: list[int]) -> tuple[int, list[RowMask]]:
        allowed = self.allowed()
        kept = next((i for i, t in enumerate(drafts) if not allowed[t]), len(drafts))
        return kept, [RowMask.of(allowed)] * (kept + 1)

    monkeypatch.setattr(Constraint, "block", first_mask_only)
    monkeypatch.setattr(Constraint, "commit", lambda self, tokens: None)
    prompt = in_process.encode(PROMPT)
    exact = exact_constrained_pairs(in_process, tiny_models["json-target"], prompt)
    counts = sample_pairs(in_process, {**PARAMS, "grammar": lark_grammar(LARK)}, CONTROL_RUNS,
                          prompt=prompt)
    outside = sum(n for cell, n in counts.items() if cell not in exact)
    assert outside > 0.05 * CONTROL_RUNS, f"wrong masks not caught: {outside} pairs outside"


# -- the gateway -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gateway_client(client: SpecDecClient) -> SpecDecClient:
    return client


def test_gateway_json_schema_answers_validate(oai: openai.OpenAI,
                                              client: SpecDecClient) -> None:
    messages: Any = [{"role": "user", "content": PROMPT}]
    form: Any = {"type": "json_schema",
                 "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}
    reply = oai.chat.completions.create(model="tiny-gpt2", messages=messages, temperature=0,
                                        max_tokens=120, response_format=form)
    text = reply.choices[0].message.content or ""
    jsonschema.validate(json.loads(text), SCHEMA)
    ids = client.encode_chat([{"role": "user", "content": PROMPT}])
    alone = client.generate(ids, num_draft_tokens=0, max_new_tokens=120, temperature=0,
                            grammar=json_schema_grammar(SCHEMA))
    assert text == alone.text
    streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
        model="tiny-gpt2", messages=messages, temperature=0, max_tokens=120,
        response_format=form, stream=True) if c.choices)
    assert streamed == text
    anything = oai.chat.completions.create(model="tiny-gpt2", messages=messages,
                                           temperature=0.8, seed=3, max_tokens=200,
                                           response_format={"type": "json_object"})
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content or ""), dict)


@pytest.mark.parametrize("form", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
    {"type": "json_schema", "json_schema": "no"},
    {"type": "xml"},
])
def test_gateway_bad_response_formats_are_400s(oai: openai.OpenAI, form: Any) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="tiny-gpt2", max_tokens=4, response_format=form,
                                    messages=[{"role": "user", "content": PROMPT}])
    assert error_of(info.value)["param"] == "response_format"


def test_a_grammar_that_does_not_compile_is_refused(client: SpecDecClient) -> None:
    with pytest.raises(SpecDecError, match="grammar"):
        client.generate(PROMPT, max_new_tokens=4, grammar='{"grammars": [{"lark": "start: ("}]}')


def tokens_per_call(client: SpecDecClient, monkeypatch: pytest.MonkeyPatch, shaped: bool,
                    overlap: bool = False, **kwargs: Any) -> float:
    """Tokens a greedy run commits per verify call; ``shaped=False`` is the negative control:
    a model drafter that ignores the generation's row rule (``Drafter.shape``)."""
    with monkeypatch.context() as patch:
        if not shaped:
            patch.setattr(LMDrafter, "shape", lambda self, shaper: None)
        result = client.generate(PROMPT, num_draft_tokens=4, max_new_tokens=80,
                                 temperature=0, overlap=overlap, **kwargs)
    return result.metrics.new_tokens / result.metrics.verify_calls


@pytest.mark.parametrize("overlap", [False, True])
def test_the_drafter_drafts_under_the_grammar(json_server: LiveServer,
                                              tiny_models: dict[str, Path],
                                              monkeypatch: pytest.MonkeyPatch,
                                              overlap: bool) -> None:
    """The target as its own drafter: drafting each row under the grammar's mask after the
    drafts before it, its drafts are the constrained target's choices and every block passes
    whole (4 drafts + the bonus); drafting the unconstrained model, its drafts leave the
    grammar at once and each call commits about one token. With ``overlap`` the next block is
    drafted while this one is verified (the rule then reads the drafts assumed accepted)."""
    twin = SpecDecClient(json_server.url, str(tiny_models["json-target"]))
    grammar = json_schema_grammar(SCHEMA)
    assert tokens_per_call(twin, monkeypatch, True, overlap, grammar=grammar) > 4.0
    assert tokens_per_call(twin, monkeypatch, False, overlap, grammar=grammar) < 2.0


def test_the_target_alone_keeps_the_grammar_on_the_verifier(client: SpecDecClient) -> None:
    """``/v1/generate`` with a grammar: its state on the verifier, one mask per step - the
    same tokens as the client's plain steps (each sending its row's mask), sampled too."""
    grammar = json_schema_grammar(SCHEMA)
    for seed in range(3):
        alone = client.baseline(PROMPT, max_new_tokens=120, temperature=1.0, seed=seed,
                                grammar=grammar)
        plain = client.generate(PROMPT, num_draft_tokens=0, max_new_tokens=120,
                                temperature=1.0, seed=seed, grammar=grammar)
        jsonschema.validate(json.loads(alone.text), SCHEMA)
        assert alone.token_ids == plain.token_ids
    # negative control: without the grammar this model writes no JSON
    free = client.baseline(PROMPT, max_new_tokens=40, temperature=0)
    with pytest.raises(ValueError):
        json.loads(free.text)


@pytest.mark.parametrize("grammar", ["%%% not a grammar", "", lark_grammar('start: "\u00e9"')])
def test_generate_refuses_a_bad_grammar(json_server: LiveServer, grammar: str) -> None:
    reply = httpx.post(f"{json_server.url}/v1/generate",
                       json={"prompt_ids": [1, 2, 3], "grammar": grammar})
    assert 400 <= reply.status_code < 500, reply.text
    assert reply.json()["error"]["field"] == "grammar"
    beams = httpx.post(f"{json_server.url}/v1/generate",
                       json={"prompt_ids": [1, 2, 3], "num_beams": 2,
                             "grammar": json_schema_grammar(SCHEMA),
                             "sampling": {"temperature": 0}})
    assert beams.status_code == 422 and beams.json()["error"]["field"] == "grammar"
    assert httpx.get(f"{json_server.url}/readyz").status_code == 200  # the server lives on


# -- grammars that cannot take a server down or carry over --------------------------------------


def chained_lark(rules: int) -> str:
    """A Lark grammar of ``rules`` rules, each calling the next: llguidance recurses along it."""
    return "\n".join(["start: r0", *(f'r{i}: r{i + 1} "a"' for i in range(rules)),
                      f'r{rules}: "b"'])


def test_a_grammar_that_crashes_llguidance_is_refused_and_the_server_serves_on(
        json_server: LiveServer, tmp_path: Path) -> None:
    """Control: llguidance itself, checking this grammar on an ordinary 8 MiB stack, dies of
    SIGSEGV. The verifier refuses it in one line naming ``grammar`` (the check runs in a child
    process) and serves the next request."""
    import llguidance

    grammar = str(llguidance.LLMatcher.grammar_from_lark(chained_lark(4000)))
    script = tmp_path / "check.py"
    script.write_text("import sys, llguidance\n"
                      "llguidance.LLMatcher.validate_grammar(sys.stdin.read())\n")
    control = subprocess.run([sys.executable, str(script)], input=grammar.encode(),
                             capture_output=True, check=False, timeout=120)
    assert control.returncode == -signal.SIGSEGV
    reply = httpx.post(f"{json_server.url}/v1/generate", timeout=60,
                       json={"prompt_ids": [5, 6, 7], "grammar": grammar})
    assert reply.status_code == 422, reply.text
    error = reply.json()["error"]
    assert error["field"] == "grammar" and "SIGSEGV" in error["message"]
    served = httpx.post(f"{json_server.url}/v1/generate", timeout=60,
                        json={"prompt_ids": [5, 6, 7], "max_new_tokens": 4,
                              "grammar": json_schema_grammar(SCHEMA)})
    assert served.status_code == 200 and len(served.json()["token_ids"]) == 4
    with pytest.raises(GrammarError, match="SIGSEGV"):  # and no client compiles it either
        lark_grammar(chained_lark(4000))
    assert lark_grammar(chained_lark(200))  # a chain a stack holds compiles


def test_a_schema_that_crashes_llguidance_is_a_400_on_the_gateway(oai: openai.OpenAI) -> None:
    """Under the schema size limit, 1,000 definitions each referring to the next crash
    llguidance's check on its small stack: a 400 naming response_format, and the gateway (in
    this process) answers the next request."""
    count = 1000
    defs: dict[str, Any] = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}}
                            for i in range(count)}
    defs[f"d{count}"] = {"type": "integer"}
    form: Any = {"type": "json_schema", "json_schema": {
        "name": "chain", "schema": {"$defs": defs, "$ref": "#/$defs/d0"}}}
    messages: Any = [{"role": "user", "content": PROMPT}]
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="tiny-gpt2", max_tokens=4, messages=messages,
                                    response_format=form)
    error = error_of(info.value)
    assert error["param"] == "response_format" and "SIGSEGV" in error["message"]
    reply = oai.chat.completions.create(model="tiny-gpt2", max_tokens=4, messages=messages,
                                        temperature=0)
    assert reply.choices[0].finish_reason == "length"


def test_a_schema_this_vocabulary_cannot_spell_is_a_400(oai: openai.OpenAI,
                                                         client: SpecDecClient) -> None:
    """``"é"`` over printable-ASCII ids: the grammar's first dead end is a 400 naming
    response_format (streamed: an error event), on the verifier's target alone a 422 naming
    grammar - never a 502 or an answer that does not parse."""
    form: Any = {"type": "json_schema", "json_schema": {"name": "e", "schema": {"const": "\u00e9"}}}
    messages: Any = [{"role": "user", "content": PROMPT}]
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="tiny-gpt2", max_tokens=8, messages=messages,
                                    response_format=form, temperature=0)
    error = error_of(info.value)
    assert error["param"] == "response_format" and error["code"] == "grammar_dead_end"
    with pytest.raises(openai.APIError, match="grammar"):
        for _ in oai.chat.completions.create(model="tiny-gpt2", max_tokens=8, stream=True,
                                             messages=messages, response_format=form):
            pass
    with pytest.raises(SpecDecError, match="grammar") as refused:
        client.baseline(PROMPT, max_new_tokens=8, grammar=json_schema_grammar({"const": "\u00e9"}))
    assert "422" in str(refused.value)


# Nested counted repeats past llguidance's lexer fuel for one step (found by walking them):
# its lexer gives up after 137 'a's, and keeps that error.
NESTED_REPEATS: dict[str, Any] = {"type": "string", "pattern": "^(a{1,76}){1,76}$"}


def walk(constraint: Constraint, tokens: int) -> int:
    """Tokens committed taking the highest id the grammar allows (not EOS), up to ``tokens``."""
    for done in range(tokens):
        allowed = np.flatnonzero(constraint.allowed())
        choice = int(allowed[allowed != 1].max())
        constraint.commit([choice])
        if constraint.matcher.is_stopped():
            return done + 1
    return tokens


def test_no_grammar_state_carries_from_one_generation_to_the_next(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A generation that runs llguidance's lexer out of fuel ends in GrammarDeadEnd; the next
    generation of the same grammar starts clean. Control: matchers copied from one compiled
    prototype (they share its lexer) refuse the next generation's first token."""
    import llguidance

    from shared.protocol import grammar as module

    tokenizer = build_ascii_tokenizer()
    compiled = json_schema_grammar(NESTED_REPEATS)

    def generations() -> tuple[bool, int]:
        with pytest.raises(GrammarDeadEnd, match="too many expressions") as first:
            walk(Constraint.of(compiled, tokenizer, 97, [1]), 400)
        try:
            return first.value is not None, walk(Constraint.of(compiled, tokenizer, 97, [1]), 5)
        except GrammarDeadEnd:
            return True, 0

    assert generations() == (True, 5)
    prototypes: dict[str, Any] = {}

    def copied(grammar: str, ll_tokenizer: Any) -> Any:
        if grammar not in prototypes:
            prototypes[grammar] = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
        return prototypes[grammar].deep_copy()

    monkeypatch.setattr(module, "_fresh_matcher", copied)
    assert generations() == (True, 0)


def test_the_same_request_gets_the_same_answer_after_a_grammar_gave_up(
        oai: openai.OpenAI) -> None:
    """Through the gateway: 'a' pushed by logit_bias walks the nested repeats until llguidance
    gives up: a 400 naming response_format, never a 200 that does not parse; then the same short
    request 10 times gets the answer it got before."""
    messages: Any = [{"role": "user", "content": PROMPT}]
    form: Any = {"type": "json_schema", "json_schema": {"name": "a", "schema": NESTED_REPEATS}}
    bias = {str(build_ascii_tokenizer().convert_tokens_to_ids("a")): 100}

    def ask(max_tokens: int) -> str:
        reply = oai.chat.completions.create(model="tiny-gpt2", messages=messages, temperature=0,
                                            max_tokens=max_tokens, response_format=form,
                                            logit_bias=bias)
        return reply.choices[0].message.content or ""

    before = ask(12)
    assert before == '"' + "a" * 11
    with pytest.raises(openai.BadRequestError) as info:
        ask(300)
    assert error_of(info.value)["code"] == "grammar_dead_end"
    assert [ask(12) for _ in range(10)] == [before] * 10


def test_the_target_alone_ends_a_grammar_that_gave_up_with_a_422(client: SpecDecClient) -> None:
    """``/v1/generate`` walking the nested repeats (its state on the verifier): 422
    grammar_dead_end naming grammar, not a 500; the verifier serves the next request."""
    from drafter_client.api import Penalties

    push = Penalties(logit_bias={build_ascii_tokenizer().convert_tokens_to_ids("a"): 100.0})
    grammar = json_schema_grammar(NESTED_REPEATS)
    with pytest.raises(SpecDecError, match="too many expressions") as refused:
        client.baseline(PROMPT, max_new_tokens=300, temperature=0, penalties=push,
                        grammar=grammar)
    assert "422" in str(refused.value)
    short = client.baseline(PROMPT, max_new_tokens=12, temperature=0, penalties=push,
                            grammar=grammar)
    assert short.text == '"' + "a" * 11
