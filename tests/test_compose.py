"""docker-compose.yml against the Compose Specification schema, plus the promises it must keep.

No Docker engine or compose plugin exists on the build machines, so the file is validated with
the published JSON schema (deploy/compose-spec.json, see deploy/README.md) after the same
`${VAR:-default}` interpolation compose applies, with environment variables unset.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
VARIABLE = re.compile(r"\$\{([A-Z0-9_]+)(?::?-([^}]*))?\}")


INTEGER_FIELDS = {"replicas"}  # fields the schema types as integer that the file interpolates


def interpolate(node: Any, key: str = "") -> Any:
    """Compose's interpolation with no variables set; an interpolated integer field becomes an
    int, as compose casts interpolated values to the field's type."""
    if isinstance(node, dict):
        return {k: interpolate(value, k) for k, value in node.items()}
    if isinstance(node, list):
        return [interpolate(value) for value in node]
    if isinstance(node, str) and "${" in node:
        value = VARIABLE.sub(lambda m: m.group(2) or "", node)
        return int(value) if key in INTEGER_FIELDS else value
    return node


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    raw = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return interpolate(raw)  # type: ignore[no-any-return]


def test_compose_file_follows_the_specification(compose: dict[str, Any]) -> None:
    schema = json.loads((ROOT / "deploy" / "compose-spec.json").read_text())
    validator = jsonschema.Draft201909Validator(schema)  # the schema names draft 2019-09
    errors = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(compose)]
    assert errors == []


def test_schema_check_is_not_vacuous(compose: dict[str, Any]) -> None:
    schema = json.loads((ROOT / "deploy" / "compose-spec.json").read_text())
    broken = json.loads(json.dumps(compose))
    broken["services"]["verifier"]["healthcheck"]["interval"] = {"seconds": 10}
    broken["services"]["verifier"]["restart_policy_typo"] = "always"
    assert len(list(jsonschema.Draft201909Validator(schema).iter_errors(broken))) >= 2


def test_services_keep_their_promises(compose: dict[str, Any]) -> None:
    services = compose["services"]
    verifier = services["verifier"]
    probe = verifier["healthcheck"]["test"]
    assert "/readyz" in " ".join(probe)
    assert not any(" " in arg for arg in probe)  # Podman's API splits arguments on spaces
    assert verifier["depends_on"]["models"]["condition"] == "service_completed_successfully"
    assert "models:/models" in verifier["volumes"] and "models" in compose["volumes"]
    assert verifier["restart"] == "unless-stopped"
    # what a deployer sets: engine, threads, context, KV budget, API keys, quotas
    for name in ("MODEL", "ENGINE", "KERNELS", "DTYPE", "DEVICE", "THREADS", "PORT",
                 "MAX_SESSIONS", "MAX_DRAFT_TOKENS", "MAX_CONTEXT", "KV_BUDGET_TOKENS",
                 "API_KEYS", "MAX_SESSIONS_PER_KEY"):
        assert f"SPECDEC_{name}" in verifier["environment"]
    assert verifier["environment"]["SPECDEC_ENGINE"] == "auto"
    # the llama.cpp engine's files: GGUF kept, no conversion for transformers
    assert services["models"]["command"][-2:] == ["--keep-gguf", "--no-convert"]
    assert services["client"]["depends_on"]["verifier"]["condition"] == "service_healthy"
    assert "http://verifier:8000" in services["client"]["command"]
    gpu = services["verifier-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert gpu["environment"]["SPECDEC_DEVICE"] == "cuda"
    # a CUDA image of its own: CUDA torch wheels, llama.cpp's CUDA backend, on CUDA's devel image
    cuda = gpu["build"]["args"]
    assert cuda["TORCH_VARIANT"].startswith("cu") and "-DGGML_CUDA=on" in cuda["LLAMA_CMAKE_ARGS"]
    assert "devel" in cuda["BASE_IMAGE"] and gpu["image"] != verifier["image"]
    assert services["models-gpu"]["build"] == gpu["build"]
    assert gpu["depends_on"] == {"models-gpu": {"condition": "service_completed_successfully"}}
    assert "--no-convert" not in services["models-gpu"]["command"]  # transformers loads them
    lb = services["lb"]
    assert lb["profiles"] == ["scale"] and "healthcheck" in lb
    assert lb["depends_on"]["verifier"]["condition"] == "service_healthy"
    template = lb["volumes"][0].split(":")[0]
    assert (ROOT / template).exists()


def test_build_arguments_are_the_dockerfiles(compose: dict[str, Any]) -> None:
    """Every build argument compose passes is one the Dockerfile declares (an undeclared one
    is dropped with a warning), and the llama.cpp stage takes LLAMA_CMAKE_ARGS."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    declared = set(re.findall(r"^ARG ([A-Z_]+)", dockerfile, re.MULTILINE))
    for name, service in compose["services"].items():
        if isinstance(service.get("build"), dict):
            assert set(service["build"]["args"]) <= declared, name
    llama = dockerfile.split("AS llama", 1)[1].split("\nFROM ", 1)[0]
    assert 'CMAKE_ARGS="${LLAMA_CMAKE_ARGS}"' in llama and "scripts.llama_build wheel" in llama
