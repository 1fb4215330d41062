"""presence_penalty, frequency_penalty and logit_bias: applied to the target's rows at every
position of a block from the sequence so far (the drafts before a row included), exactly as a
plain decode applies them. Greedy speculation equals the target alone's under them, on every
k (plain runs included); the first two sampled tokens follow the penalized target (an
independent reference: the model's logits, the penalties written out here, transformers'
warpers), and a verifier that forgets a block's drafts when it counts must fail that test."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

import shared.protocol.acceptance as acceptance
from drafter_client.api import Penalties, SpecDecClient
from drafter_client.transport import SpecDecError
from shared.engines.drafter import LMDrafter
from shared.models.catalog import load_causal_lm
from shared.protocol.sampling import SamplingConfig, penalize
from tests.support.in_process import InProcessVerifier
from tests.support.live_server import LiveServer, fp32_settings
from tests.support.statistics import PROMPT, chi_square_p, reference_probs, sample_pairs
from tests.test_gateway import MODEL, error_of

STRONG = Penalties(presence=0.5, frequency=1.5, logit_bias={3: 2.0, 5: -100.0})
STRONG_CONFIG = SamplingConfig(1.0, presence_penalty=0.5, frequency_penalty=1.5,
                               logit_bias=((3, 2.0), (5, -100.0)))


@pytest.fixture(scope="module")
def client(gpt2_server: LiveServer, tiny_models: dict[str, Path]) -> SpecDecClient:
    return SpecDecClient(gpt2_server.url, str(tiny_models["gpt2-drafter"]))


@pytest.mark.parametrize("k", [0, 3, 8])
def test_greedy_speculation_with_penalties_equals_the_target_alone(client: SpecDecClient,
                                                                    k: int) -> None:
    prompt = "the cat sat on the"
    alone = client.baseline(prompt, max_new_tokens=40, temperature=0, penalties=STRONG)
    spec = client.generate(prompt, num_draft_tokens=k, max_new_tokens=40, temperature=0,
                           penalties=STRONG)
    assert spec.token_ids == alone.token_ids
    assert 5 not in spec.token_ids  # a bias of -100 bans it
    counts = Counter(spec.token_ids)
    # negative control: the penalties are applied (without them the output differs and repeats
    # more)
    plain = client.baseline(prompt, max_new_tokens=40, temperature=0).token_ids
    assert plain != alone.token_ids
    assert max(Counter(plain).values()) > max(counts.values())


def test_penalties_out_of_bounds_or_outside_the_vocabulary_are_refused(
        client: SpecDecClient) -> None:
    with pytest.raises(SpecDecError, match="penalties"):
        client.generate("the cat", max_new_tokens=2, penalties=Penalties(presence=3.0))
    with pytest.raises(SpecDecError, match="logit_bias"):
        client.generate("the cat", max_new_tokens=2,
                        penalties=Penalties(logit_bias={client.info.vocab_size: 1.0}))
    assert client.generate("the cat", max_new_tokens=2).token_ids  # the verifier still serves


def test_penalize_counts_the_history_and_the_drafts_before_each_row() -> None:
    rows = torch.zeros(3, 6)
    config = STRONG_CONFIG
    out = penalize(rows, config, {1: 2}, [[], [4], [4, 4]])
    assert out[0].tolist() == [0.0, -(1.5 * 2 + 0.5), 0.0, 2.0, 0.0, -100.0]
    assert out[2, 4].item() == pytest.approx(-(1.5 * 2 + 0.5))
    assert out[1, 4].item() == pytest.approx(-(1.5 + 0.5))


def test_penalize_is_bit_equal_to_one_id_at_a_time() -> None:
    """The vectorised penalties against the rule written one id at a time, on random rows with
    -inf, -0.0 and large values; the control moves one count and must differ."""
    generator = torch.Generator().manual_seed(3)
    rows = torch.randn(5, 300, generator=generator) * 30
    rows[:, ::17] = float("-inf")
    rows[:, 5::23] = -0.0
    ids = torch.randperm(300, generator=generator)[:90].tolist()
    history = dict(zip(ids, torch.randint(1, 9, (90,), generator=generator).tolist(),
                       strict=True))
    before = [[], [7], [7, 7], [7, 200], [0, 17, 299]]

    def one_at_a_time(counts_of: dict[int, int]) -> torch.Tensor:
        out = rows.float().clone()
        for r, extra in enumerate(before):
            counts = dict(counts_of)
            for token in extra:
                counts[token] = counts.get(token, 0) + 1
            ids = torch.tensor(list(counts), dtype=torch.long)
            seen = torch.tensor(list(counts.values()), dtype=torch.float32)
            out[r, ids] -= 1.5 * seen + 0.5
        return out

    config = SamplingConfig(1.0, presence_penalty=0.5, frequency_penalty=1.5)
    got = penalize(rows, config, history, before)
    assert torch.equal(got.view(torch.int32), one_at_a_time(history).view(torch.int32))
    moved = dict(history)
    moved[next(iter(moved))] += 1
    assert not torch.equal(got, one_at_a_time(moved))


def test_a_history_longer_than_the_session_is_refused(gpt2_server: LiveServer) -> None:
    from drafter_client.transport import HttpVerifier, VerifierHTTPError
    from shared.protocol.schema import CreateSessionRequest, SamplingParams, VerifyRequest

    verifier = HttpVerifier(gpt2_server.url)
    session = verifier.create_session(CreateSessionRequest(
        prompt_ids=[5, 6, 7], sampling=SamplingParams(presence_penalty=0.5))).session_id
    with pytest.raises(VerifierHTTPError) as info:
        verifier.verify(session, VerifyRequest(position=3, last_token=7, final_uniform=0.5,
                                               history=[(7, 2), (9, 2)]))
    assert info.value.field == "history" and "at most 3" in str(info.value)
    ok = verifier.verify(session, VerifyRequest(position=3, last_token=7, final_uniform=0.5,
                                                history=[(7, 1), (9, 2)]))
    assert ok.next_token >= 0  # the session survives and serves
    verifier.delete_session(session)  # the shared server's other tests count its sessions


# -- the sampled distribution ------------------------------------------------------------------

RUNS = 3000
CONTROL_RUNS = 2000
# On the peaky 16-token pair: negative penalties at OpenAI's bound (a repeat gains 4 in its
# logit: the peaky target seldom repeats itself, so a row that misses a count shows; at a gain
# of 3, a drafter drafting under the penalties left the control short of power at 2,000 draws),
# a bias up and a ban.
PEAKY = Penalties(presence=-2.0, frequency=-2.0, logit_bias={2: 1.5, 7: -100.0})


@pytest.fixture(scope="module")
def peaky_client(tiny_models: dict[str, Path]) -> SpecDecClient:
    verifier = InProcessVerifier.load(fp32_settings(tiny_models["peaky-target"],
                                                    max_draft_tokens=8))
    return SpecDecClient(verifier, str(tiny_models["peaky-drafter"]), dtype="float32",
                         device="cpu")


def exact_penalized_pairs(model_dir: Path, params: dict[str, float],
                          eos: list[int]) -> dict[tuple[int, ...], float]:
    """P(first two tokens) of the penalized target, written out without our code."""
    model = load_causal_lm(str(model_dir), torch.float32, torch.device("cpu"))
    bias = torch.zeros(16)
    for token, value in PEAKY.logit_bias.items():
        bias[token] = value
    with torch.no_grad():
        first_logits = model(torch.tensor([PROMPT])).logits[0, -1] + bias
        first = reference_probs(first_logits[None], params)[0]
        batch = torch.tensor([[*PROMPT, t] for t in range(16)])
        second_logits = model(batch).logits[:, -1] + bias  # [16, 16]
        for t in range(16):  # the first token, generated once before the second
            second_logits[t, t] -= PEAKY.frequency + PEAKY.presence
        second = reference_probs(second_logits, params)
    cells: dict[tuple[int, ...], float] = {}
    for t1 in range(16):
        if t1 in eos:
            cells[(t1, -1)] = float(first[t1])
            continue
        for t2 in range(16):
            cells[(t1, t2)] = float(first[t1] * second[t1, t2])
    return cells


PARAMS: dict[str, Any] = {"temperature": 1.0}


@pytest.mark.slow
def test_first_two_tokens_follow_the_penalized_target(peaky_client: SpecDecClient,
                                                      tiny_models: dict[str, Path]) -> None:
    exact = exact_penalized_pairs(tiny_models["peaky-target"], PARAMS,
                                  peaky_client.info.eos_token_ids)
    counts = sample_pairs(peaky_client, {**PARAMS, "penalties": PEAKY}, RUNS)
    assert not any(7 in cell for cell in counts)  # banned
    p_value, tv = chi_square_p(counts, exact)
    assert p_value > 1e-3, f"chi-square p = {p_value:.2e}, TV = {tv:.3f}"
    assert tv < 0.1, f"TV = {tv:.3f}"


@pytest.mark.slow
def test_negative_control_drafts_not_counted(peaky_client: SpecDecClient,
                                             tiny_models: dict[str, Path],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A verifier that penalizes every row of a block by the history alone (forgetting the
    drafts before the row) must fail the same test."""
    def history_only(self: acceptance.Block, rows: torch.Tensor) -> torch.Tensor:
        return penalize(rows, self.config, dict(self.history), [[]] * rows.shape[0])

    monkeypatch.setattr(acceptance.Block, "penalized", history_only)
    exact = exact_penalized_pairs(tiny_models["peaky-target"], PARAMS,
                                  peaky_client.info.eos_token_ids)
    counts = sample_pairs(peaky_client, {**PARAMS, "penalties": PEAKY}, CONTROL_RUNS,
                          exact=exact)
    p_value, tv = chi_square_p(counts, exact)
    assert p_value < 1e-6, f"wrong penalties not caught: p = {p_value:.2e}, TV = {tv:.3f}"


# -- the gateway -------------------------------------------------------------------------------


def test_gateway_penalties_are_the_target_alones(oai: openai.OpenAI,
                                                 client: SpecDecClient) -> None:
    kwargs: Any = {"model": MODEL, "prompt": "the cat sat on the", "temperature": 0,
                   "max_tokens": 24, "presence_penalty": 0.5, "frequency_penalty": 1.5,
                   "logit_bias": {"3": 2.0, "5": -100}}
    reply = oai.completions.create(**kwargs)
    ids = client.encode("the cat sat on the")
    alone = client.baseline(ids, max_new_tokens=24, temperature=0, penalties=STRONG)
    assert reply.choices[0].text == alone.text
    streamed = "".join(c.choices[0].text for c in oai.completions.create(stream=True, **kwargs)
                       if c.choices)
    assert streamed == alone.text


@pytest.mark.parametrize(("logit_bias", "param"), [
    ({"64": 1.0}, "logit_bias"), ({"x": 1.0}, "logit_bias"), ({"3": 101.0}, "logit_bias"),
    ({"²": 1.0}, "logit_bias"), ({"①": 1.0}, "logit_bias"), ({"٣": 1.0}, "logit_bias")])
def test_gateway_bad_logit_bias_is_a_400(oai: openai.OpenAI, logit_bias: dict[str, float],
                                         param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL, prompt="the cat", max_tokens=2,
                               logit_bias=logit_bias)  # type: ignore[arg-type]
    assert error_of(info.value)["param"] == param


def test_the_drafter_drafts_under_the_penalties(gpt2_server: LiveServer,
                                                tiny_models: dict[str, Path],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The target as its own drafter: drafting each row with the penalties the target's row
    will get (the generated tokens and the drafts before it counted), its greedy drafts are the
    target's choices and pass; drafting the unpenalised model (the negative control: a drafter
    that ignores ``Drafter.shape``), many fail."""
    twin = SpecDecClient(gpt2_server.url, str(tiny_models["gpt2-target"]))

    def passed(shaped: bool) -> float:
        with monkeypatch.context() as patch:
            if not shaped:
                patch.setattr(LMDrafter, "shape", lambda self, shaper: None)
            result = twin.generate("the cat sat on the", num_draft_tokens=4, max_new_tokens=60,
                                   temperature=0, penalties=STRONG)
        return result.metrics.accepted_tokens / result.metrics.drafted_tokens

    assert passed(True) > 0.9
    assert passed(False) < 0.5, passed(False)
