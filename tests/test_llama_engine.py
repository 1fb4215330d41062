"""The llama.cpp engine (verifier ``--engine llama-cpp``) and drafter (``--drafter-engine
llama-cpp``) on tiny GGUF files written from the tiny transformers Llama pairs
(``tests/support/tiny_gguf.py``).

The reference for greedy exactness is llama.cpp's own greedy decoding of the same file (one
token per decode, one sequence); for sampling, the exact distribution of the first two tokens
enumerated from the engine's own logits, processed with transformers' warpers.
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from drafter_client import SpecDecClient
from drafter_client.api import DrafterOptions
from drafter_client.transport import VerifierHTTPError
from shared.engines.drafter import common_prefix
from shared.engines.llama_cpp.drafter import LlamaCppDrafter
from shared.engines.llama_cpp.runtime import GGUFWeights, LlamaModel, Segment, default_threads
from shared.models.catalog import load_causal_lm
from shared.protocol.sampling import SamplingConfig
from tests.support.in_process import CallGroup, InProcessVerifier
from tests.support.live_server import LiveServer
from tests.support.statistics import (
    PROMPT,
    accept_everything,
    chi_square_p,
    pair_cells,
    reference_probs,
    sample_pairs,
)
from tests.support.tiny_gguf import llama_greedy, save_tiny_gguf
from verifier_service.settings import Settings

PROMPTS = ["the cat sat on", "def x ( y ) :", "a big red dog ran to the"]


@pytest.fixture(scope="module")
def ggufs(tiny_models: dict[str, Path]) -> dict[str, Path]:
    """``model.gguf`` beside the tiny Llama checkpoints (their tokenizer next to it)."""
    return {name: save_tiny_gguf(tiny_models[name])
            for name in ("llama-target", "llama-drafter", "peaky-target", "peaky-drafter")}


def llama_settings(path: Path, **overrides: object) -> Settings:
    return Settings(model=str(path), engine="llama-cpp", threads=1, **overrides)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def server_settings(ggufs: dict[str, Path]) -> Settings:
    return llama_settings(ggufs["llama-target"], max_draft_tokens=8, max_context=64)


def expected(ggufs: dict[str, Path], ids: list[int], n: int, eos: list[int]) -> list[int]:
    out = llama_greedy(ggufs["llama-target"], ids, n)
    return out[:next((i + 1 for i, t in enumerate(out) if t in eos), len(out))]


# -- the runtime
def test_default_threads_keep_to_omp_num_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp's thread count when none is given: the process's OMP_NUM_THREADS budget (as
    PyTorch's engines), else every core it may run on; a budget that is not a count is none."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = default_threads()
    assert cores >= 1
    monkeypatch.setenv("OMP_NUM_THREADS", str(cores + 2))
    assert default_threads() == cores + 2
    for unset in ("0", "", "four"):
        monkeypatch.setenv("OMP_NUM_THREADS", unset)
        assert default_threads() == cores


def test_gguf_logits_equal_the_checkpoint(tiny_models: dict[str, Path],
                                          ggufs: dict[str, Path]) -> None:
    """The written file is the model: llama.cpp's logits are transformers' up to rounding."""
    ids = [2, 3, 4, 5, 6, 7, 8, 9]
    model = load_causal_lm(str(tiny_models["llama-target"]), torch.float32, torch.device("cpu"))
    with torch.no_grad():
        reference = model(torch.tensor([ids])).logits[0].numpy()
    lm = LlamaModel(str(ggufs["llama-target"]), n_seqs=1, seq_tokens=32, threads=1)
    [rows] = lm.decode([Segment(0, 0, ids, 0)])
    assert rows is not None and rows.shape == reference.shape
    assert np.abs(rows - reference).max() < 0.05 * np.abs(reference).max()
    assert (rows.argmax(-1) == reference.argmax(-1)).all()


def test_one_decode_over_sequences_with_rollback(ggufs: dict[str, Path]) -> None:
    """Two sequences in one decode score as each alone; rewriting a sequence from a position
    drops what it held there (a verify block's rejected drafts)."""
    ids = [2, 3, 4, 5, 6, 7, 8, 9]
    lm = LlamaModel(str(ggufs["llama-target"]), n_seqs=2, seq_tokens=32, threads=1)
    [alone] = lm.decode([Segment(0, 0, ids, 0)])
    lm.remove(0)
    first, second = lm.decode([Segment(0, 0, ids[:5], 0), Segment(1, 0, [9, 9, 9], 0)])
    [rest] = lm.decode([Segment(0, 5, [11, 12], 0)])  # a block that will be rejected
    [again] = lm.decode([Segment(0, 5, ids[5:], 0)])  # written over it
    assert lm.length(0) == len(ids) and lm.length(1) == 3
    assert alone is not None and first is not None and again is not None
    assert np.allclose(np.concatenate([first, again]), alone, atol=1e-4)
    assert lm.decodes == 4


def test_llama_drafter_rolls_back_to_the_committed_prefix(ggufs: dict[str, Path]) -> None:
    weights = GGUFWeights(str(ggufs["llama-drafter"]))
    drafter = LlamaCppDrafter(weights, vocab_size=64, seq_tokens=64, threads=1)
    drafter.reset([2, 3, 4])
    draft = drafter.propose(4, SamplingConfig(), torch.Generator())
    assert drafter.cached == [2, 3, 4, *draft.ids[:3]]
    drafter.commit([draft.ids[0], 7 if draft.ids[1] != 7 else 8])
    assert drafter.cached == [2, 3, 4, draft.ids[0]] and drafter.lm.length(0) == 4
    follow = drafter.propose(3, SamplingConfig(), torch.Generator())
    fresh = LlamaCppDrafter(weights, vocab_size=64, seq_tokens=64, threads=1)
    fresh.reset(drafter.committed)
    assert follow.ids == fresh.propose(3, SamplingConfig(), torch.Generator()).ids
    # a new sequence keeps the cached common prefix with its prompt (a chat's next turn)
    again = [*drafter.committed, 20, 21]
    kept = common_prefix(drafter.cached, again)
    drafter.reset(again)
    assert drafter.cached == again[:kept] and drafter.lm.length(0) == kept > 3
    fresh.reset(again)
    assert (drafter.propose(3, SamplingConfig(), torch.Generator()).ids
            == fresh.propose(3, SamplingConfig(), torch.Generator()).ids)
    # sampled drafts: q rows processed as the transformers drafter's
    config = SamplingConfig(temperature=0.7, top_k=5)
    drafter.reset([2, 3, 4])
    sampled = drafter.propose(2, config, torch.Generator().manual_seed(0))
    assert sampled.probs is not None and sampled.probs.shape == (2, 64)
    assert (sampled.probs > 0).sum(-1).max() <= 5
    assert torch.allclose(sampled.probs.sum(-1), torch.ones(2), atol=1e-5)


def test_llama_drafter_drafts_less_then_nothing_at_its_context_end(
        ggufs: dict[str, Path]) -> None:
    """Past its own context the drafter drafts what fits, then nothing (the target goes on
    alone), and it never speculates past it; it raised ValueError before."""
    weights = GGUFWeights(str(ggufs["llama-drafter"]))
    drafter = LlamaCppDrafter(weights, vocab_size=64, seq_tokens=8, threads=1)
    assert drafter.context_tokens == 8
    greedy, generator = SamplingConfig(), torch.Generator()
    drafter.reset([2, 3, 4, 5, 6])
    drafts = drafter.propose(2, greedy, generator).ids
    ahead = drafter.speculate(drafts, 4, greedy, generator)  # 7 assumed, the guess: 8
    assert len(drafts) == 2 and ahead is not None and len(ahead[1].ids) == 1
    drafter.reset([2, 3, 4, 5, 6])
    drafts = drafter.propose(6, greedy, generator).ids
    assert len(drafts) == 4  # it fed the 5 committed tokens and 3 drafts: 8
    assert drafter.speculate(drafts, 4, greedy, generator) is None
    drafter.reset([2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert drafter.propose(4, greedy, generator).ids == []
    sampled = drafter.propose(4, SamplingConfig(temperature=1.0), generator)
    assert sampled.ids == [] and drafter.propose_tree(4, greedy).ids == []


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generation_to_the_verifier_context_edge_with_a_drafter_of_that_context(
        temperature: float, tiny_models: dict[str, Path], ggufs: dict[str, Path]) -> None:
    """The verifier's context equals the drafter's trained context (256): with ``--overlap``
    the generation runs to the context's end, ends with finish_reason "length", and greedy
    output equals llama.cpp's own greedy decoding."""
    verifier = InProcessVerifier.load(llama_settings(ggufs["llama-target"], max_draft_tokens=8,
                                                     max_context=256))
    client = SpecDecClient(verifier, str(ggufs["llama-drafter"]), options=DrafterOptions(
        engine="llama-cpp", threads=1, lookup=False, overlap=True))
    ids = (client.encode(PROMPTS[1]) * 64)[:236]  # a long prompt: no end of text on the way
    room = 256 - len(ids)
    result = client.generate(ids, num_draft_tokens=8, max_new_tokens=room,
                             temperature=temperature, seed=1)
    assert (len(result.token_ids), result.finish_reason) == (room, "length")
    if temperature == 0.0:
        assert result.token_ids == llama_greedy(ggufs["llama-target"], ids, room)


# -- greedy exactness
DRAFTERS = {
    "transformers model": ("llama-drafter-hf", DrafterOptions()),
    "llama.cpp model": ("llama-drafter", DrafterOptions(engine="llama-cpp", threads=1)),
    "llama.cpp model, overlap": ("llama-drafter", DrafterOptions(engine="llama-cpp", threads=1,
                                                                 lookup=False, overlap=True)),
    "ngram": ("ngram", DrafterOptions()),
    "prompt-lookup": ("prompt-lookup", DrafterOptions()),
}


def make_client(url: str | InProcessVerifier, name: str, tiny_models: dict[str, Path],
                ggufs: dict[str, Path]) -> SpecDecClient:
    spec, options = DRAFTERS[name]
    if spec == "llama-drafter-hf":
        return SpecDecClient(url, str(tiny_models["llama-drafter"]), dtype="float32",
                             device="cpu", options=options)
    if spec == "llama-drafter":
        return SpecDecClient(url, str(ggufs["llama-drafter"]), options=options)
    return SpecDecClient(url, spec, tokenizer=str(tiny_models["llama-target"]), options=options)


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_greedy_equals_llama_cpp_greedy(name: str, k: int, server: LiveServer,
                                        tiny_models: dict[str, Path],
                                        ggufs: dict[str, Path]) -> None:
    client = make_client(server.url, name, tiny_models, ggufs)
    accepted = 0
    for prompt in PROMPTS:
        ids = client.encode(prompt)
        result = client.generate(ids, num_draft_tokens=k, max_new_tokens=24)
        assert result.token_ids == expected(ggufs, ids, 24, client.info.eos_token_ids), \
            f"{name} k={k} {prompt!r}"
        accepted += result.metrics.accepted_tokens
    if "model" in name:
        assert accepted > 0


def test_target_alone_and_info(server: LiveServer, tiny_models: dict[str, Path],
                               ggufs: dict[str, Path]) -> None:
    client = SpecDecClient(server.url, None, tokenizer=str(tiny_models["llama-target"]))
    assert (client.info.dtype, client.info.device, client.info.max_context) == ("f32", "cpu", 64)
    assert [k for k, _ in client.info.verify_ms][:3] == [0, 1, 2]
    ids = client.encode(PROMPTS[0])
    result = client.baseline(ids, max_new_tokens=20)
    assert result.token_ids == expected(ggufs, ids, 20, client.info.eos_token_ids)


def test_greedy_in_one_batch_with_other_sessions(tiny_models: dict[str, Path],
                                                 ggufs: dict[str, Path]) -> None:
    """Three clients whose every call runs in one batched decode (``CallGroup``)."""
    verifier = InProcessVerifier.load(llama_settings(ggufs["llama-target"], max_draft_tokens=8,
                                                     max_context=64))
    clients = [make_client(verifier, "llama.cpp model", tiny_models, ggufs) for _ in PROMPTS]
    results: dict[int, list[int]] = {}
    calls: dict[int, int] = {}
    verifier.group = CallGroup(verifier.engine, len(clients))
    forwards = verifier.engine.counters()["llama_forwards"]

    def work(i: int) -> None:
        try:
            ids = clients[i].encode(PROMPTS[i])
            result = clients[i].generate(ids, num_draft_tokens=3 + i, max_new_tokens=24)
            results[i], calls[i] = result.token_ids, result.metrics.verify_calls
        finally:
            verifier.group.leave()  # type: ignore[union-attr]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(clients))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i, prompt in enumerate(PROMPTS):
        ids = clients[i].encode(prompt)
        assert results[i] == expected(ggufs, ids, 24, clients[i].info.eos_token_ids)
    # one decode per round of calls, not one per call
    assert verifier.engine.counters()["llama_forwards"] - forwards == max(calls.values())


def test_beam_search_equals_the_transformers_engine(server: LiveServer,
                                                    llama_server: LiveServer,
                                                    tiny_models: dict[str, Path]) -> None:
    """Beam search reorders llama.cpp sequences (seq_cp); the beams it finds on the GGUF file
    are those the transformers engine finds on the same checkpoint."""
    ours = SpecDecClient(server.url, None, tokenizer=str(tiny_models["llama-target"]))
    theirs = SpecDecClient(llama_server.url, None, tokenizer=str(tiny_models["llama-target"]))
    for prompt in PROMPTS[:2]:
        ids = ours.encode(prompt)
        got = ours.baseline(ids, max_new_tokens=12, num_beams=3)
        want = theirs.baseline(ids, max_new_tokens=12, num_beams=3)
        assert got.token_ids == want.token_ids, prompt


# -- what the engine refuses, and what it survives
def test_trees_are_refused_with_a_clear_422(server: LiveServer, ggufs: dict[str, Path]) -> None:
    client = SpecDecClient(server.url, str(ggufs["llama-drafter"]),
                           options=DrafterOptions(engine="llama-cpp", threads=1, tree_width=2,
                                                  lookup=False))
    with pytest.raises(VerifierHTTPError) as caught:
        client.generate(client.encode(PROMPTS[0]), num_draft_tokens=3, max_new_tokens=8)
    assert caught.value.status == 422 and caught.value.code == "tree_unsupported"
    plain = SpecDecClient(server.url, "ngram", tokenizer=str(ggufs["llama-target"]))
    assert plain.generate(plain.encode(PROMPTS[0]), max_new_tokens=8).token_ids


def test_bad_input_and_eviction(ggufs: dict[str, Path]) -> None:
    settings = llama_settings(ggufs["llama-target"], max_context=64, kv_budget_tokens=128,
                              session_protect_s=0.0)
    with LiveServer(settings) as live, httpx.Client(base_url=live.url) as http:
        bad = http.post("/v1/sessions", json={"prompt_ids": [2, 64]})
        assert bad.status_code == 422 and bad.json()["error"]["field"] == "prompt_ids"
        too_long = http.post("/v1/sessions", json={"prompt_ids": [2] * 64})
        assert too_long.status_code == 413 and too_long.json()["error"]["field"] == "prompt_ids"
        ids = [http.post("/v1/sessions", json={"prompt_ids": [2, 3]}).json()["session_id"]
               for _ in range(3)]  # two slots: the third evicts the first
        gone = http.post(f"/v1/sessions/{ids[0]}/verify", json={
            "position": 2, "last_token": 3, "final_uniform": 0.5})
        assert gone.status_code == 404
        kept = http.post(f"/v1/sessions/{ids[2]}/verify", json={
            "position": 2, "last_token": 3, "draft_ids": [4, 5], "log_uniforms": [-0.1, -0.2],
            "final_uniform": 0.5})
        assert kept.status_code == 200, kept.text
        position, token = kept.json()["position"], kept.json()["next_token"]
        wrong = http.post(f"/v1/sessions/{ids[2]}/verify", json={
            "position": position, "last_token": token, "draft_ids": [99], "log_uniforms": [-0.1],
            "final_uniform": 0.5})
        assert wrong.status_code == 422 and wrong.json()["error"]["field"] == "draft_ids"
        # the session survived its bad call, its rejected drafts rolled back
        after = http.post(f"/v1/sessions/{ids[2]}/verify", json={
            "position": position, "last_token": token, "final_uniform": 0.5})
        assert after.status_code == 200, after.text
        assert after.json()["position"] == position + 1


def test_settings_refuse_what_the_engine_cannot_do(ggufs: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="cuda_graphs"):
        llama_settings(ggufs["llama-target"], cuda_graphs=True)
    with pytest.raises(ValueError, match="device"):
        llama_settings(ggufs["llama-target"], device="cuda")
    from shared.engines import resolve

    drafter = str(ggufs["llama-drafter"])
    with pytest.raises(ValueError, match="cuda_graphs"):
        resolve("llama-cpp", drafter, "cpu").load_drafter(drafter, cuda_graphs=True)


# -- the sampled distribution
def engine_pair_distribution(path: Path, params: dict[str, float], eos: list[int],
                             prompt: list[int] = PROMPT) -> dict[tuple[int, int], float]:
    """P(first two tokens) from llama.cpp's own logits of the file (one decode per prefix)."""
    lm = LlamaModel(str(path), n_seqs=1, seq_tokens=32, threads=1)
    [rows] = lm.decode([Segment(0, 0, prompt, len(prompt) - 1)])
    assert rows is not None
    first = reference_probs(torch.from_numpy(rows), params)[0]
    seconds = []
    for token in range(first.shape[0]):
        [row] = lm.decode([Segment(0, len(prompt), [token], 0)])
        seconds.append(torch.from_numpy(row))  # type: ignore[arg-type]
    second = reference_probs(torch.cat(seconds), params)
    return pair_cells(first, second, eos)


@pytest.fixture(scope="module")
def sampled_client(ggufs: dict[str, Path]) -> SpecDecClient:
    verifier = InProcessVerifier.load(llama_settings(ggufs["peaky-target"], max_draft_tokens=8))
    return SpecDecClient(verifier, str(ggufs["peaky-drafter"]),
                         options=DrafterOptions(engine="llama-cpp", threads=1, lookup=False))


SAMPLED = {"T=1": {"temperature": 1.0}, "T=0.7,top-k=5": {"temperature": 0.7, "top_k": 5}}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SAMPLED))
def test_sampled_first_two_tokens_follow_the_llama_cpp_target(
        name: str, sampled_client: SpecDecClient, ggufs: dict[str, Path]) -> None:
    params = SAMPLED[name]
    exact = engine_pair_distribution(ggufs["peaky-target"], params,
                                     sampled_client.info.eos_token_ids)
    counts: Counter = sample_pairs(sampled_client, params, 3000, workers=4)
    p_value, tv = chi_square_p(counts, exact)
    assert p_value > 1e-3 and tv < 0.1, f"{name}: p = {p_value:.2e}, TV = {tv:.3f}"


@pytest.mark.slow
def test_negative_control_on_the_llama_cpp_engine(sampled_client: SpecDecClient,
                                                  ggufs: dict[str, Path],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    accept_everything(monkeypatch)
    params = SAMPLED["T=1"]
    exact = engine_pair_distribution(ggufs["peaky-target"], params,
                                     sampled_client.info.eos_token_ids)
    counts = sample_pairs(sampled_client, params, 2000, exact=exact, workers=4)
    p_value, tv = chi_square_p(counts, exact)
    assert p_value < 1e-6, f"wrong rule not caught: p = {p_value:.2e}, TV = {tv:.3f}"


def test_auto_picks_llama_cpp_for_a_gguf_file_on_a_cpu(ggufs: dict[str, Path],
                                                       tiny_models: dict[str, Path]) -> None:
    from shared.engines import resolve
    from shared.engines.llama_cpp.target import LlamaCppEngine
    from verifier_service.settings import load_engine

    gguf = str(ggufs["llama-target"])
    assert resolve("auto", gguf, "cpu").name == "llama-cpp"
    assert resolve("auto", gguf, "cuda").name == "transformers"
    assert resolve("auto", str(tiny_models["llama-target"]), "cpu").name == "transformers"
    assert resolve("transformers", gguf, "cpu").name == "transformers"
    engine = load_engine(Settings(model=gguf, threads=1, max_context=64, device="cpu"))
    assert isinstance(engine, LlamaCppEngine)
    client = SpecDecClient(InProcessVerifier(engine, Settings(model=gguf, max_context=64)),
                           str(ggufs["llama-drafter"]), device="cpu")
    assert isinstance(client.drafter.model, LlamaCppDrafter)  # type: ignore[union-attr]


def test_auto_picks_llama_cpp_for_a_short_name_whose_gguf_is_kept(
        ggufs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`make demo`'s short names: llama.cpp on a CPU once the GGUF file is kept, transformers
    (the converted folder) without it, and on CUDA."""
    from shared.engines import resolve
    from shared.engines.llama_cpp.runtime import kept_gguf, resolve_gguf
    from shared.models.catalog import OFFLINE_MODELS

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    name = "qwen2.5-coder-1.5b"
    assert kept_gguf(name) is None
    assert resolve("auto", name, "cpu").name == "transformers"  # not kept: the folder's engine
    kept = tmp_path / "gguf" / OFFLINE_MODELS[name].gguf_name
    kept.parent.mkdir()
    kept.symlink_to(ggufs["llama-target"])
    assert kept_gguf(name) == kept
    assert resolve("auto", name, "cpu").name == "llama-cpp"
    assert resolve("auto", name, "cuda").name == "transformers"
    assert resolve("transformers", name, "cpu").name == "transformers"
    assert kept_gguf("some/hub-id") is None
    # no converted folder beside it: the GGUF's own vocabulary is the tokenizer
    assert resolve_gguf(name) == (str(kept), str(kept))


def test_llama_cpp_drafter_drafts_trees_for_the_transformers_verifier(
        llama_server: LiveServer, tiny_models: dict[str, Path], ggufs: dict[str, Path]) -> None:
    """Trees are the verifier engine's limit, not the drafter's: the llama.cpp drafter's token
    trees verified on the transformers engine give the target's own greedy output."""
    from tests.support.tiny_models import hf_greedy

    client = SpecDecClient(llama_server.url, str(ggufs["llama-drafter"]),
                           options=DrafterOptions(engine="llama-cpp", threads=1, tree_width=2,
                                                  lookup=False))
    for prompt in PROMPTS[:2]:
        ids = client.encode(prompt)
        result = client.generate(ids, num_draft_tokens=4, max_new_tokens=20)
        expected = hf_greedy(tiny_models["llama-target"], ids, 20)
        cut = next((i + 1 for i, t in enumerate(expected) if t == 1), len(expected))
        assert result.token_ids == expected[:cut], prompt
        assert result.metrics.accepted_tokens > 0


def test_the_openai_gateway_on_both_llama_cpp_sides(server: LiveServer,
                                                    ggufs: dict[str, Path]) -> None:
    """``specdec serve`` with the llama.cpp drafter in front of the llama.cpp verifier: four
    concurrent completions (each on its own fork: a context of its own on shared weights)
    give llama.cpp's own greedy output."""
    from concurrent.futures import ThreadPoolExecutor

    from drafter_client.gateway import GatewaySettings, create_gateway
    from tests.support.servers import ThreadedServer

    client = SpecDecClient(server.url, str(ggufs["llama-drafter"]),
                           options=DrafterOptions(engine="llama-cpp", threads=1))
    with ThreadedServer(create_gateway(client, GatewaySettings("tiny-llama"))) as gateway:
        def complete(prompt: str) -> str:
            reply = httpx.post(gateway.url + "/v1/completions", timeout=60, json={
                "model": "tiny-llama", "prompt": prompt, "max_tokens": 16, "temperature": 0})
            assert reply.status_code == 200, reply.text
            return str(reply.json()["choices"][0]["text"])

        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(complete, [*PROMPTS, PROMPTS[0]]))
    for prompt, got in zip([*PROMPTS, PROMPTS[0]], texts, strict=True):
        want = expected(ggufs, client.encode(prompt), 16, client.info.eos_token_ids)
        text = client.tokenizer.decode(want, skip_special_tokens=True)
        assert got.split() == text.split(), prompt
