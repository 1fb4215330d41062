"""Token trees and hybrid drafting: the tree rule by hand, greedy output equal to the target's
own greedy output for trees and hybrid drafts over HTTP, the verifier's KV compaction, and
clear errors for malformed trees."""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from drafter_client import SpecDecClient
from drafter_client.api import DrafterOptions
from shared.engines.drafter import Draft, TreeBuilder
from shared.protocol.acceptance import accept_tree, tree_depths, verify_tree
from shared.protocol.sampling import SamplingConfig
from tests.support.tiny_models import hf_greedy

PROMPTS = ["the cat sat on", "def x ( y ) :", "a big red dog ran to the", "if x = 1",
           "the cat sat on the mat the cat sat on"]
NEG = -1e4


def logits_rows(*best: int, vocab: int = 6) -> torch.Tensor:
    """One row per argument: +10 at that id, -10 elsewhere."""
    rows = torch.full((len(best), vocab), -10.0)
    for i, b in enumerate(best):
        rows[i, b] = 10.0
    return rows


def test_greedy_tree_follows_the_argmax_branch() -> None:
    # root -> 0:[3] -> 2:[4];  root -> 1:[5] -> 3:[1]
    parents, ids = [-1, -1, 0, 1], [3, 5, 4, 1]
    rows = logits_rows(
        5,  # row 0 (after the root): 5 -> node 1
        0,  # row 1 (after node 0): unused
        2,  # row 2 (after node 1): 2, no child of node 1 has it -> stop, next token 2
        0,  # row 3 (after node 2): unused
        0,  # row 4 (after node 3): unused
    )
    verdict = verify_tree(rows, ids, parents, [0.0] * 4, 0.5, SamplingConfig())
    assert verdict.path == [1] and verdict.next_token == 2
    rows[2] = logits_rows(1)[0]  # row 2 now picks 1 -> node 3, then row 4 gives the bonus 0
    verdict = verify_tree(rows, ids, parents, [0.0] * 4, 0.5, SamplingConfig())
    assert verdict.path == [1, 3] and verdict.next_token == 0


def test_sampled_tree_tests_children_without_replacement() -> None:
    # Row 0: p = (0.5, 0.3, 0.2) over ids 0..2; children 0 -> id 0, 1 -> id 1 (both leaves).
    p = torch.tensor([0.5, 0.3, 0.2])
    rows = torch.log(p).repeat(3, 1)
    parents, ids = [-1, -1], [0, 1]
    # u0 = 0.6 rejects id 0 (0.6 > 0.5); child 1 is then tested against p' = p without id 0:
    # p'(1) = 0.3 / 0.5 = 0.6, so u1 = 0.55 accepts it, u1 = 0.65 rejects it.
    accept = verify_tree(rows, ids, parents, [math.log(0.6), math.log(0.55)], 0.0,
                         SamplingConfig(temperature=1.0))
    assert accept.path == [1]
    reject = verify_tree(rows, ids, parents, [math.log(0.6), math.log(0.65)], 0.0,
                         SamplingConfig(temperature=1.0))
    assert reject.path == [] and reject.next_token == 2  # p' has only id 2 left
    # The naive rule (test child 1 against the untouched p: 0.55 > 0.3) would reject it.
    assert math.log(0.55) > math.log(0.3)


def test_duplicate_siblings_are_never_accepted_twice() -> None:
    path, rejected = accept_tree([-1, -1], [4, 4], [math.log(0.9), math.log(1e-9)],
                                 node_logprobs=[math.log(0.5), math.log(0.5)])
    assert path == [] and rejected == [4]


def test_tree_builder_shares_prefixes_and_limits_depth() -> None:
    tree = TreeBuilder()
    tree.add_path([1, 2, 3])
    tree.add_path([1, 2, 4])
    tree.add_path([5])
    draft = tree.draft()
    assert draft.ids == [1, 2, 3, 4, 5] and draft.parents == [-1, 0, 1, 1, -1]
    assert draft.depth == 3 and tree_depths(draft.parents) == [1, 2, 3, 3, 1]
    cut = draft.limited(max_depth=2, max_nodes=10)
    assert cut.ids == [1, 2, 5] and cut.parents == [-1, 0, -1]
    assert draft.limited(3, 2).ids == [1, 2]
    assert Draft([1, 2, 3], None, None).limited(2, 8).ids == [1, 2]


def _expected(model_dir, client, ids, n):  # type: ignore[no-untyped-def]
    expected = hf_greedy(model_dir, ids, n)
    eos = client.info.eos_token_ids
    return expected[:next((i + 1 for i, t in enumerate(expected) if t in eos), len(expected))]


@pytest.mark.parametrize("options", [
    DrafterOptions(lookup=False, tree_width=2),
    DrafterOptions(lookup=False, tree_width=3, draft_min_prob=0.5),
    DrafterOptions(lookup=True),
    DrafterOptions(lookup=True, tree_width=2, lookup_tokens=5),
], ids=["tree2", "tree3-minprob", "hybrid", "hybrid-tree"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_greedy_trees_and_hybrid_match_target_generate(arch, options, tiny_models,  # type: ignore[no-untyped-def]
                                                       gpt2_server, llama_server):
    server = gpt2_server if arch == "gpt2" else llama_server
    client = SpecDecClient(server.url, str(tiny_models[f"{arch}-drafter"]), dtype="float32",
                           device="cpu", options=options)
    accepted = off_chain = 0

    def count(outcome):  # type: ignore[no-untyped-def]
        nonlocal off_chain
        path = outcome.accepted_path or []
        off_chain += path != list(range(len(path)))  # the KV cache was compacted

    for prompt in PROMPTS:
        ids = client.encode(prompt)
        for k in (2, 5):
            result = client.generate(ids, num_draft_tokens=k, max_new_tokens=24,
                                     on_block=count)
            assert result.token_ids == _expected(tiny_models[f"{arch}-target"], client, ids,
                                                 24), f"{prompt!r} k={k}"
            m = result.metrics
            assert m.new_tokens == m.verify_calls + m.accepted_tokens
            accepted += m.accepted_tokens
    assert accepted > 0
    if options.tree_width > 1:
        assert off_chain > 0, "no block accepted a path off the first chain"


def test_verifier_rejects_malformed_trees(tiny_models, gpt2_server) -> None:  # type: ignore[no-untyped-def]
    with httpx.Client(base_url=gpt2_server.url) as http:
        sid = http.post("/v1/sessions", json={"prompt_ids": [2, 3, 4]}).json()["session_id"]
        base = {"position": 3, "last_token": 4, "draft_ids": [5, 6], "log_uniforms": [0.0, 0.0],
                "final_uniform": 0.5}
        for bad, field in (({"tree_parents": [-1, 1]}, "tree_parents"),
                           ({"tree_parents": [-1]}, "tree_parents"),
                           ({"tree_parents": [-1, -2]}, "tree_parents"),
                           ({"tree_parents": [-1, 0], "draft_logprobs": [-1.0, -1.0]},
                            "draft_logprobs")):
            r = http.post(f"/v1/sessions/{sid}/verify", json={**base, **bad})
            assert r.status_code == 422, r.text
            assert field in r.text
        # The session survived: a good tree verifies at the same position.
        r = http.post(f"/v1/sessions/{sid}/verify", json={**base, "tree_parents": [-1, -1]})
        assert r.status_code == 200, r.text
        assert r.json()["position"] == 4 + len(r.json()["accepted_path"])
        assert http.delete(f"/v1/sessions/{sid}").status_code in (200, 204)  # shared server


@pytest.mark.parametrize("options", [
    DrafterOptions(lookup=False, overlap=True),
    DrafterOptions(lookup=False, overlap=True, tree_width=2),
    DrafterOptions(overlap=True, lookup=True, tree_width=2),
    DrafterOptions(lookup=False, overlap=True, draft_min_prob=0.5),
], ids=["chain", "tree", "hybrid-tree", "min-prob"])
def test_overlapped_drafting_keeps_greedy_output(options, tiny_models, llama_server):  # type: ignore[no-untyped-def]
    """Drafting block n + 1 while block n is in flight changes nothing in the output; the
    drafts made ahead are used when block n went as assumed."""
    client = SpecDecClient(llama_server.url, str(tiny_models["llama-drafter"]), dtype="float32",
                           device="cpu", options=options)
    ahead = 0

    def count(outcome):  # type: ignore[no-untyped-def]
        nonlocal ahead
        ahead += outcome.drafted_ahead

    for prompt in PROMPTS:
        ids = client.encode(prompt)
        for k in (1, 4):
            result = client.generate(ids, num_draft_tokens=k, max_new_tokens=24, on_block=count)
            assert result.token_ids == _expected(tiny_models["llama-target"], client, ids, 24)
    assert ahead > 0, "no draft made ahead was ever used"


def test_overlapped_drafting_is_reproducible_when_sampling(tiny_models, llama_server):  # type: ignore[no-untyped-def]
    """The draft ahead has its own seeded randomness: a seed gives one output, with or without
    the overlap's timing, and the same one twice."""
    client = SpecDecClient(llama_server.url, str(tiny_models["llama-drafter"]), dtype="float32",
                           device="cpu", options=DrafterOptions(lookup=False, overlap=True))
    ids = client.encode(PROMPTS[0])
    runs = [client.generate(ids, num_draft_tokens=3, max_new_tokens=20, temperature=1.0,
                            seed=7).token_ids for _ in range(2)]
    assert runs[0] == runs[1]
