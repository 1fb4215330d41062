"""Encoder-decoder targets (tiny T5 and BART pairs built offline): greedy output equals
transformers' `generate(do_sample=False)` with every drafter kind, beam search equals
`generate(num_beams=N)`, sampling passes the chi-square test of tests/test_distribution.py, and
bad input gets the same 4xx."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForSeq2SeqLM

from drafter_client import SpecDecClient
from drafter_client.transport import SpecDecError
from tests.support.in_process import InProcessVerifier
from tests.support.live_server import LiveServer, fp32_settings
from tests.support.servers import ThreadedServer
from tests.support.statistics import (
    accept_everything,
    chi_square_p,
    pair_cells,
    reference_probs,
    sample_pairs,
)
from verifier_service.settings import Settings

SOURCES = [[5, 6, 7, 8, 1], [9, 3, 22, 1], [40, 41, 1], [12, 30, 12, 30, 12, 1]]


def hf_seq2seq(model_dir: Path, source: list[int], **kwargs: Any) -> list[int]:
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([source]), do_sample=False, **kwargs)
    return out[0, 1:].tolist()  # type: ignore[no-any-return]  # after the decoder start token


@pytest.fixture(scope="module", params=["t5", "bart"])
def arch(request: pytest.FixtureRequest) -> str:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def server_settings(arch: str, tiny_models: dict[str, Path]) -> Settings:
    return fp32_settings(tiny_models[f"{arch}-target"], max_draft_tokens=8)


@pytest.fixture(scope="module")
def pair(arch: str, server: LiveServer) -> tuple[str, LiveServer]:
    """The architecture and the module's verifier on its tiny target."""
    return arch, server


@pytest.mark.parametrize("drafter", ["model", "ngram", "prompt-lookup"])
def test_greedy_equals_transformers(pair: Any, tiny_models: dict[str, Path],
                                    drafter: str) -> None:
    arch, server = pair
    target = tiny_models[f"{arch}-target"]
    spec = str(tiny_models[f"{arch}-drafter"]) if drafter == "model" else drafter
    client = SpecDecClient(server.url, spec, str(target) if drafter != "model" else None,
                           dtype="float32")
    assert client.info.is_encoder_decoder
    accepted = 0
    for source in SOURCES:
        reference = hf_seq2seq(target, source, max_new_tokens=20)
        for k in (1, 4):
            result = client.generate(source, num_draft_tokens=k, max_new_tokens=20)
            assert result.token_ids == reference, (source, k)
            accepted += result.metrics.accepted_tokens
        assert client.baseline(source, max_new_tokens=20).token_ids == reference
    assert accepted > 0  # the drafts did something


@pytest.mark.parametrize("beams", [2, 4])
def test_beam_search_equals_transformers(pair: Any, tiny_models: dict[str, Path],
                                         beams: int) -> None:
    arch, server = pair
    target = tiny_models[f"{arch}-target"]
    client = SpecDecClient(server.url, None, str(target))
    for source in SOURCES:
        for penalty, early in ((1.0, False), (0.5, True), (2.0, "never")):
            ours = client.baseline(source, max_new_tokens=12, num_beams=beams,
                                   length_penalty=penalty, early_stopping=early).token_ids
            assert ours == hf_seq2seq(target, source, max_new_tokens=12, num_beams=beams,
                                      length_penalty=penalty, early_stopping=early)


def test_text_prompt_is_the_encoder_input(pair: Any, tiny_models: dict[str, Path]) -> None:
    """A text prompt is encoded as the tokenizer does for the encoder (special tokens kept)."""
    arch, server = pair
    target = tiny_models[f"{arch}-target"]
    client = SpecDecClient(server.url, str(tiny_models[f"{arch}-drafter"]), dtype="float32")
    ids = client.tokenizer("the cat sat")["input_ids"]
    result = client.generate("the cat sat", max_new_tokens=12)
    assert result.token_ids == hf_seq2seq(target, list(ids), max_new_tokens=12)


def test_bad_input(pair: Any, tiny_models: dict[str, Path], llama_server: LiveServer) -> None:
    arch, server = pair
    url = server.url
    cases = [
        ({"prompt_ids": [0]}, 422, "encoder_ids"),  # missing: an encoder-decoder target
        ({"prompt_ids": [0], "encoder_ids": [5, 64]}, 422, "encoder_ids"),  # out of vocab
        ({"prompt_ids": [0], "encoder_ids": []}, 422, "encoder_ids"),
        ({"prompt_ids": [0], "encoder_ids": [5] * 5000}, 413, "encoder_ids"),
    ]
    for body, status, field in cases:
        for path in ("/v1/sessions", "/v1/generate"):
            r = httpx.post(url + path, json={**body, "max_new_tokens": 4}
                           if path == "/v1/generate" else body)
            assert r.status_code == status, (path, body, r.text)
            assert field in (r.json()["error"]["field"] or ""), r.text
    # a decoder-only target refuses encoder_ids
    r = httpx.post(llama_server.url + "/v1/sessions", json={"prompt_ids": [2],
                                                            "encoder_ids": [3]})
    assert r.status_code == 422 and r.json()["error"]["field"] == "encoder_ids"
    # a decoder-only drafter for an encoder-decoder target: one clear error
    with pytest.raises(SpecDecError, match="encoder-decoder"):
        SpecDecClient(url, str(tiny_models["gpt2-drafter"]), dtype="float32")
    # still serving
    assert httpx.post(url + "/v1/generate", json={"prompt_ids": [0], "encoder_ids": [5, 1],
                                                  "max_new_tokens": 3}).status_code == 200


def exact_seq2seq_pairs(model_dir: Path, source: list[int], start: int,
                        params: dict[str, float], eos: list[int]) -> dict[tuple[int, int], float]:
    """P(first two decoder tokens) from the target itself, with transformers' warpers."""
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        enc = torch.tensor([source])
        first = reference_probs(model(input_ids=enc, decoder_input_ids=torch.tensor(
            [[start]])).logits[0, -1:], params)[0]  # [V]
        vocab = first.shape[0]
        dec = torch.tensor([[start, t] for t in range(vocab)])
        second = reference_probs(model(input_ids=enc.expand(vocab, -1),
                                       decoder_input_ids=dec).logits[:, -1], params)  # [V, V]
    return pair_cells(first, second, eos)


@pytest.fixture(scope="module")
def peaky_client(tiny_models: dict[str, Path]) -> SpecDecClient:
    verifier = InProcessVerifier.load(fp32_settings(tiny_models["peaky-t5-target"],
                                                    max_draft_tokens=8))
    return SpecDecClient(verifier, str(tiny_models["peaky-t5-drafter"]), dtype="float32",
                         device="cpu")


PEAKY_SOURCE = [5, 6, 7, 1]


def exact_for(client: SpecDecClient, tiny_models: dict[str, Path],
              params: dict[str, float]) -> dict[tuple[int, int], float]:
    return exact_seq2seq_pairs(tiny_models["peaky-t5-target"], PEAKY_SOURCE,
                               client.info.decoder_start_token_id or 0, params,
                               client.info.eos_token_ids)


@pytest.mark.slow
@pytest.mark.parametrize("params", [{"temperature": 0.7, "top_p": 0.9}])
def test_sampling_follows_the_target(peaky_client: SpecDecClient, tiny_models: dict[str, Path],
                                     params: dict[str, float]) -> None:
    exact = exact_for(peaky_client, tiny_models, params)
    assert max(exact.values()) < 0.8  # not degenerate: the test can tell distributions apart
    # 3,000 draws, as the decoder-only variants (tests/test_distribution.py): the acceptance
    # code is theirs; this checks the encoder-decoder path around it
    p_value, tv = chi_square_p(sample_pairs(peaky_client, params, 3000, PEAKY_SOURCE), exact)
    assert p_value > 1e-3 and tv < 0.1, (p_value, tv)


@pytest.mark.slow
def test_negative_control_accept_everything(peaky_client: SpecDecClient,
                                            tiny_models: dict[str, Path],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The same test catches a wrong acceptance rule on this path too."""
    accept_everything(monkeypatch)
    params = {"temperature": 1.0}
    exact = exact_for(peaky_client, tiny_models, params)
    p_value, tv = chi_square_p(sample_pairs(peaky_client, params, 2000, PEAKY_SOURCE,
                                            exact=exact), exact)
    assert p_value < 1e-6, f"wrong rule not caught: p = {p_value:.2e}, TV = {tv:.3f}"


def test_openai_completions_on_an_encoder_decoder_target(pair: Any,
                                                         tiny_models: dict[str, Path]) -> None:
    """`specdec serve` in front of a T5 / BART verifier: the prompt is the encoder's input."""
    import openai

    from drafter_client.gateway import GatewaySettings, create_gateway

    arch, server = pair
    client = SpecDecClient(server.url, str(tiny_models[f"{arch}-drafter"]), dtype="float32")
    expected = client.generate("the cat sat", max_new_tokens=10)
    with ThreadedServer(create_gateway(client, GatewaySettings("tiny-s2s"))) as gateway:
        oai = openai.OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0)
        reply = oai.completions.create(model="tiny-s2s", prompt="the cat sat", temperature=0,
                                       max_tokens=10)
    assert reply.choices[0].text == expected.text
    assert reply.usage is not None
    assert reply.usage.completion_tokens == len(expected.token_ids)


def test_drafter_keeps_the_encoding_of_the_same_source(tiny_models: dict[str, Path]) -> None:
    """A new sequence on the same source reuses the drafter's encoding and cross-attention (one
    encoder run), and drafts what a fresh drafter drafts; another source is encoded anew."""
    from shared.engines.transformers.drafter import HFSeq2SeqDrafter
    from shared.protocol.sampling import SamplingConfig

    model = AutoModelForSeq2SeqLM.from_pretrained(str(tiny_models["t5-drafter"])).eval()
    encoder = model.get_encoder()
    runs = []
    hook = encoder.register_forward_hook(lambda *_: runs.append(1))
    config = SamplingConfig(temperature=1.0)
    source, other = [5, 6, 7, 8, 1], [9, 10, 11, 1]

    def draft(drafter: HFSeq2SeqDrafter, src: list[int], seed: int) -> list[int]:
        drafter.reset([0], src)
        drafter.commit([])
        return drafter.propose(3, config, torch.Generator().manual_seed(seed)).ids

    kept = HFSeq2SeqDrafter(model, 64)
    first = draft(kept, source, 1)
    draft(kept, source, 2)  # a second sequence (the first's cache is rolled back)
    again = draft(kept, source, 1)
    assert len(runs) == 1 and again == first
    draft(kept, other, 1)
    assert len(runs) == 2
    hook.remove()
    assert first == draft(HFSeq2SeqDrafter(model, 64), source, 1)
