"""A real network between client and verifier: two namespaces joined by a veth pair, 20 ms delay
and 1% packet loss on the verifier's side. Generations complete and greedy output is identical
to the target's own greedy decoding (what it is over loopback: test_cli_e2e.py). Skipped where
namespaces cannot be made (not root)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from tests.support import netns
from tests.support.tiny_models import hf_greedy

WHY_NOT = netns.available()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(WHY_NOT is not None,
                                                    reason=f"network namespaces: {WHY_NOT}")]


def cli_args(url: str, drafter: Path, prompt: str) -> list[str]:
    return ["generate", "--verifier-url", url, "--drafter", str(drafter), "--dtype", "float32",
            "--prompt", prompt, "--max-new-tokens", "48", "-k", "4", "--json",
            "--timeout-s", "20", "--retry-budget-s", "60"]


@pytest.mark.slow  # a generation over a link that delays and drops packets
def test_generation_over_a_delayed_lossy_link(tiny_models: dict[str, Path]) -> None:
    verifier_args = ["--model", str(tiny_models["gpt2-target"]), "--dtype", "float32",
                     "--device", "cpu", "--threads", "1", "--max-draft-tokens", "8"]
    prompts = ["the cat sat on", "def x ( y ) :", "a big red dog ran to the"]
    with netns.NetPair() as net:
        how = net.impair(delay_ms=20, loss_pct=1)
        procs, url = net.serve(verifier_args, delay_ms=20)
        try:
            runs = net.client_runs([cli_args(url, tiny_models["gpt2-drafter"], prompt)
                                    for prompt in prompts])
            for run in runs:
                assert run.returncode == 0, run.stderr
                result = orjson.loads(run.stdout)
                # The target's own greedy decoding, cut after its first EOS (id 1).
                greedy = hf_greedy(tiny_models["gpt2-target"], result["prompt_token_ids"], 48)
                cut = next((i + 1 for i, t in enumerate(greedy) if t == 1), len(greedy))
                assert len(result["token_ids"]) > 0
                assert result["token_ids"] == greedy[:cut], how
                # Each verify round trip crossed the delayed link.
                assert result["metrics"]["verify_latency_ms"]["p50"] >= 20, how
        finally:
            netns.stop(procs)
