"""`--tp-plan auto` under torchrun: a target sharded over 2 CPU ranks (gloo) serves the same
greedy, speculative and beam output as the whole model in one process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from drafter_client.api import SpecDecClient
from tests.support.tiny_models import hf_greedy
from verifier_service.launch import free_port, wait_ready

TORCHRUN = Path(sys.executable).parent / "torchrun"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed")]


@pytest.mark.timeout(300)
def test_two_ranks_serve_the_same_output(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    target = tiny_models["llama-target"]  # 4 heads, 2 KV heads: 2 + 1 per rank
    port = free_port()
    log = (tmp_path / "torchrun.log").open("wb")
    proc = subprocess.Popen(
        [str(TORCHRUN), "--nproc-per-node", "2", "--master-port", str(free_port()), "-m",
         "verifier_service.cli", "--model", str(target), "--tp-plan", "auto", "--port",
         str(port), "--dtype", "float32", "--device", "cpu"],
        stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parent.parent,
        env={**os.environ, "SPECDEC_THREADS": "1"}, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc, timeout_s=180)
        reference = hf_greedy(target, [2, 3, 4], 24)
        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        beam = model.generate(torch.tensor([[2, 3, 4]]), num_beams=3, do_sample=False,
                              max_new_tokens=12, pad_token_id=1)[0, 3:].tolist()
        client = SpecDecClient(url, str(tiny_models["llama-drafter"]), dtype="float32")
        assert client.generate([2, 3, 4], max_new_tokens=24).token_ids == reference
        assert client.baseline([2, 3, 4], max_new_tokens=24).token_ids == reference
        assert client.baseline([2, 3, 4], max_new_tokens=12, num_beams=3).token_ids == beam
        sampled = client.generate([2, 3, 4], max_new_tokens=16, temperature=0.8, seed=1)
        assert len(sampled.token_ids) >= 1
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # torchrun passes it to both ranks
        proc.wait(timeout=60)
        log.close()
    print((tmp_path / "torchrun.log").read_text()[-2000:])


def test_tp_plan_needs_torchrun(tiny_models: dict[str, Path]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    proc = subprocess.run([sys.executable, "-m", "verifier_service.cli", "--model",
                           str(tiny_models["llama-target"]), "--tp-plan", "auto"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and "torchrun" in proc.stderr
    both = subprocess.run([sys.executable, "-m", "verifier_service.cli", "--model",
                           str(tiny_models["llama-target"]), "--tp-plan", "auto",
                           "--device-map", "auto"], capture_output=True, text=True, timeout=60,
                          env=env)
    assert both.returncode == 2 and "device_map" in both.stderr
