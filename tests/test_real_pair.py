"""The real Qwen2.5-Coder 0.5B -> 1.5B pair (`make test-real`; needs shared/models/fetch.py).

fp32 so that greedy speculative output must equal the target's own generate() token for token.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from drafter_client import SpecDecClient
from drafter_client.api import DrafterOptions
from shared.models.catalog import ModelSpecError, load_causal_lm, resolve_model_spec
from tests.support.live_server import LiveServer
from verifier_service.settings import Settings

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def server_settings() -> Settings:
    """``server``: the 1.5B target on transformers, in float32."""
    try:
        resolve_model_spec("qwen2.5-coder-1.5b")
        resolve_model_spec("qwen2.5-coder-0.5b")
    except ModelSpecError as exc:
        pytest.skip(str(exc))
    return Settings(model="qwen2.5-coder-1.5b", engine="transformers", dtype="float32",
                    device="cpu")  # type: ignore[arg-type]


def test_real_pair_greedy_is_exact_in_fp32(server):  # type: ignore[no-untyped-def]
    client = SpecDecClient(server.url, "qwen2.5-coder-0.5b", dtype="float32", device="cpu",
                           options=DrafterOptions(engine="transformers"))
    prompt = client.encode("Write a Python function that reverses a string.", chat=True)
    result = client.generate(prompt, num_draft_tokens=4, max_new_tokens=32)
    target = load_causal_lm("qwen2.5-coder-1.5b", torch.float32, torch.device("cpu"))
    expected = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32,
                               eos_token_id=client.info.eos_token_ids)[0, len(prompt):].tolist()
    assert result.token_ids == expected
    assert result.metrics.accepted_tokens > 0


def test_real_pair_sampling_runs(server):  # type: ignore[no-untyped-def]
    client = SpecDecClient(server.url, "qwen2.5-coder-0.5b", dtype="float32", device="cpu",
                           options=DrafterOptions(engine="transformers"))
    result = client.generate("def fibonacci(n):", num_draft_tokens=4, max_new_tokens=24,
                             temperature=0.7, top_p=0.9, seed=1)
    assert 0 < len(result.token_ids) <= 24
    assert result.metrics.verify_calls < len(result.token_ids) or len(result.token_ids) == 1


@pytest.fixture(scope="module")
def llama_cpp_server(start_server: Callable[[Settings], LiveServer]) -> LiveServer:
    """The Q4_K_M target on the llama.cpp engine."""
    from shared.engines.llama_cpp.runtime import resolve_gguf

    try:
        resolve_gguf("qwen2.5-coder-1.5b")
        resolve_gguf("qwen2.5-coder-0.5b")
    except ModelSpecError as exc:
        pytest.skip(f"{exc} (the llama.cpp engine's test)")
    return start_server(Settings(model="qwen2.5-coder-1.5b", engine="llama-cpp", threads=2,
                                 kv_budget_tokens=8192))  # type: ignore[arg-type]


def test_real_pair_on_llama_cpp(llama_cpp_server):  # type: ignore[no-untyped-def]
    """The Q4_K_M pair on the llama.cpp engine: the target alone is llama.cpp's own one-token
    greedy decoding exactly; speculative greedy output is compared with it and where it first
    differs is reported (llama.cpp's multi-token decodes round differently at near-ties:
    docs/benchmarks.md, the llama.cpp section)."""
    from shared.engines.llama_cpp.runtime import resolve_gguf
    from tests.support.tiny_gguf import llama_greedy

    client = SpecDecClient(llama_cpp_server.url, "qwen2.5-coder-0.5b",
                           options=DrafterOptions(engine="llama-cpp", threads=2))
    prompt = client.encode("Write a Python function that reverses a string.", chat=True)
    reference = llama_greedy(resolve_gguf("qwen2.5-coder-1.5b")[0], prompt, 32)
    eos = client.info.eos_token_ids
    reference = reference[:next((i + 1 for i, t in enumerate(reference) if t in eos),
                                len(reference))]
    alone = client.baseline(prompt, max_new_tokens=32)
    assert alone.token_ids == reference
    result = client.generate(prompt, max_new_tokens=32)
    same = next((i for i, (a, b) in enumerate(zip(result.token_ids, reference, strict=False))
                 if a != b), None)
    print(f"speculative greedy first differs from llama.cpp's at token {same}")  # reported


def test_real_pair_structured_output_on_llama_cpp(llama_cpp_server):  # type: ignore[no-untyped-def]
    """A JSON schema on the Q4_K_M pair (llama.cpp engine, exact kernels): greedy speculation
    under the grammar equals the target alone under it (``/v1/generate``, the grammar's state on
    the verifier), and the answer validates; the drafter drafts under the same masks."""
    import json

    import jsonschema

    from shared.protocol.grammar import json_schema_grammar

    schema = {"type": "object", "additionalProperties": False,
              "required": ["name", "parameters", "returns"],
              "properties": {"name": {"type": "string"},
                             "parameters": {"type": "array", "maxItems": 4,
                                            "items": {"type": "string"}},
                             "returns": {"enum": ["str", "int", "list", "None"]}}}
    client = SpecDecClient(llama_cpp_server.url, "qwen2.5-coder-0.5b",
                           options=DrafterOptions(engine="llama-cpp", threads=2))
    prompt = client.encode("Describe a Python function that reverses a string, as JSON.",
                           chat=True)
    grammar = json_schema_grammar(schema)
    alone = client.baseline(prompt, max_new_tokens=64, grammar=grammar)
    spec = client.generate(prompt, num_draft_tokens=4, max_new_tokens=64, grammar=grammar)
    assert spec.token_ids == alone.token_ids
    jsonschema.validate(json.loads(spec.text), schema)
    assert spec.metrics.accepted_tokens > 0
    print(f"{spec.text!r}: {spec.metrics.accepted_tokens} of {spec.metrics.drafted_tokens} "
          f"drafts accepted, {spec.metrics.verify_calls} calls")  # reported


def test_real_vocabulary_pattern_schema_speculates_at_k_16(llama_cpp_server):  # type: ignore[no-untyped-def]
    """A free-text pattern on Qwen2.5's 151,936-id vocabulary (about 42,000 ids allowed a row)
    at 16 drafts: every block's 17 masks fit the verifier's body limit (as id lists they were
    2-4 MB: every call a 413), drafts are accepted, and greedy output equals the target alone
    under the same grammar."""
    import re

    from shared.protocol.grammar import json_schema_grammar

    client = SpecDecClient(llama_cpp_server.url, "qwen2.5-coder-0.5b",
                           options=DrafterOptions(engine="llama-cpp", threads=2))
    prompt = client.encode("Describe a cat in a few lowercase words.", chat=True)
    grammar = json_schema_grammar({"type": "string", "pattern": "^[a-z ]+$"})
    alone = client.baseline(prompt, max_new_tokens=40, grammar=grammar)
    spec = client.generate(prompt, num_draft_tokens=16, max_new_tokens=40, grammar=grammar)
    assert spec.token_ids == alone.token_ids
    assert spec.metrics.accepted_tokens > 0, spec.metrics
    assert re.fullmatch(r'"[a-z ]*"?', spec.text), spec.text
