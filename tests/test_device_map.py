"""`--device-map`: a target placed by accelerate (here: over the CPU and disk offload, the path a
model larger than one GPU takes) serves the same greedy output as the model on one device."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from drafter_client.api import SpecDecClient
from shared.engines.transformers.models import attention_devices, parse_device_map
from shared.engines.transformers.target import CausalEngine
from tests.support.live_server import LiveServer, fp32_settings
from tests.support.tiny_models import hf_greedy
from verifier_service.settings import load_engine

DISK_MAPS = {
    "llama-target": {"model.embed_tokens": "cpu", "model.layers.0": "cpu",
                     "model.layers.1": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu",
                     "lm_head": "cpu"},
    "gpt2-target": {"transformer.wte": "cpu", "transformer.wpe": "cpu", "transformer.h.0": "disk",
                    "transformer.h.1": "cpu", "transformer.ln_f": "cpu", "lm_head": "cpu"},
}


@pytest.mark.parametrize("name", ["llama-target", "gpt2-target"])
@pytest.mark.parametrize("placement", ["auto", "disk"])
def test_placed_target_serves_the_same_output(tiny_models: dict[str, Path], tmp_path: Path,
                                              name: str, placement: str) -> None:
    device_map = "auto" if placement == "auto" else json.dumps(DISK_MAPS[name])
    settings = fp32_settings(tiny_models[name], device_map=device_map,
                             offload_folder=str(tmp_path / "offload"))
    reference = hf_greedy(tiny_models[name], [2, 3, 4], 20)
    with LiveServer(settings) as server:
        drafter = str(tiny_models[name.replace("target", "drafter")])
        client = SpecDecClient(server.url, drafter, dtype="float32")
        assert client.generate([2, 3, 4], max_new_tokens=20).token_ids == reference
        assert client.baseline([2, 3, 4], max_new_tokens=20).token_ids == reference
        assert client.baseline([2, 3, 4], max_new_tokens=8, num_beams=2).token_ids
    if placement == "disk":  # the offloaded layer's weights really are off the device
        runner = load_engine(settings)
        assert isinstance(runner, CausalEngine)
        assert any(p.device.type == "meta" for p in runner.model.parameters())
        assert all(k.device.type == "cpu" for k in runner.pool.keys)


class _Hook:
    def __init__(self, device: Any) -> None:
        self.execution_device = device


def test_attention_devices_follow_the_placement() -> None:
    """Each layer's KV slots go where accelerate runs that layer (its hook, or a parent's)."""
    layers = torch.nn.ModuleList()
    for i in range(3):
        layer = torch.nn.Module()
        layer.self_attn = torch.nn.Linear(2, 2, device="meta" if i == 0 else "cpu")
        layer.self_attn.layer_idx = i  # type: ignore[assignment]
        layers.append(layer)
    layers[1]._hf_hook = _Hook(1)  # type: ignore[assignment]  # a GPU index
    layers[2]._hf_hook = _Hook("cpu")  # type: ignore[assignment]
    model = torch.nn.Module()
    model.layers = layers
    devices = attention_devices(model, 3, torch.device("cpu"))  # layer 0: offloaded, no hook
    assert devices == [torch.device("cpu"), torch.device("cuda:1"), torch.device("cpu")]
    layers[0]._hf_hook = _Hook("cuda:0")  # type: ignore[assignment]
    assert attention_devices(model, 3, torch.device("cpu"))[0] == torch.device("cuda:0")
    lone = SimpleNamespace(named_modules=lambda: iter([]))
    assert attention_devices(lone, 2, torch.device("cpu")) == [torch.device("cpu")] * 2


def test_parse_device_map() -> None:
    assert parse_device_map("") is None
    assert parse_device_map("auto") == "auto"
    assert parse_device_map('{"": "cpu"}') == {"": "cpu"}


@pytest.mark.parametrize("value", ['{"model.layers.0": ', '["cpu"]'])
def test_bad_device_map_is_one_line_exit_2(tiny_models: dict[str, Path], value: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "verifier_service.cli", "--model",
                           str(tiny_models["gpt2-target"]), "--device-map", value, "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--device-map" in proc.stderr.strip().splitlines()[-1]
