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
    assert "models:/models:ro" in verifier["volumes"] and "models" in compose["volumes"]
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


# -- closed by default ---------------------------------------------------------------------

WRITES_MODELS = {"models", "models-gpu"}  # specdec-fetch fills /models; nothing else writes it


def test_every_port_is_published_on_loopback_only(compose: dict[str, Any]) -> None:
    published = {name: service["ports"] for name, service in compose["services"].items()
                 if "ports" in service}
    assert set(published) == {"verifier", "verifier-gpu", "gateway", "lb"}
    for name, ports in published.items():
        for port in ports:
            assert isinstance(port, str) and port.startswith("127.0.0.1:"), (name, port)
    raw = (ROOT / "docker-compose.yml").read_text()
    # one variable opens them all, and replicas keep the address with ephemeral host ports
    assert raw.count("${SPECDEC_BIND:-127.0.0.1}:") == len(published)
    [spec] = yaml.safe_load(raw)["services"]["verifier"]["ports"]
    replicas = VARIABLE.sub(lambda m: {"SPECDEC_VERIFIER_PUBLISH": ":8000"}.get(
        m.group(1), m.group(2) or ""), spec)
    assert replicas == "127.0.0.1::8000"  # docs/deploy.md's scale-out: ephemeral host ports


def test_models_is_read_only_but_where_it_is_fetched(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        mounts = [v for v in service.get("volumes", []) if v.split(":")[1] == "/models"]
        if name in WRITES_MODELS:
            assert mounts == ["models:/models"], name
        elif name != "lb":  # nginx mounts no models
            assert mounts == ["models:/models:ro"], name
    # what the verifier measures lives in a volume only the verifiers mount
    for name, service in compose["services"].items():
        measured = "measurements:/var/cache/specdec" in service.get("volumes", [])
        assert measured == name.startswith("verifier"), name
        if measured:
            assert all(service["environment"][f"SPECDEC_{v}"].startswith("/var/cache/specdec/")
                       for v in ("VERIFY_COSTS", "DTYPE_CACHE", "LLAMA_AMX_CACHE"))
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "chown specdec /models /var/cache/specdec" in dockerfile


def test_every_container_is_locked_down(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        assert service["read_only"] is True, name
        assert service["cap_drop"] == ["ALL"], name
        assert service["security_opt"] == ["no-new-privileges:true"], name
        assert "/tmp" in service["tmpfs"], name
        assert re.fullmatch(r"[0-9]+[mg]", service["mem_limit"]), name
    # nginx's master only switches its workers' user and owns their temporary folders
    assert set(compose["services"]["lb"]["cap_add"]) == {"CHOWN", "SETGID", "SETUID"}
    assert all("cap_add" not in s for n, s in compose["services"].items() if n != "lb")


def test_the_gateway_is_closed_and_keeps_its_key_off_the_command_line(
        compose: dict[str, Any]) -> None:
    gateway = compose["services"]["gateway"]
    assert not any("api-key" in arg for arg in gateway["command"])
    assert "--serve-api-key" not in (ROOT / "docker-compose.yml").read_text()
    env = gateway["environment"]
    assert "SPECDEC_SERVE_API_KEY" in env  # from the environment, where ps does not show it
    # bound to 0.0.0.0 in its container: the allow-list is what refuses a rebound name
    assert env["SPECDEC_SERVE_ALLOWED_HOSTS"] == "localhost,127.0.0.1,[::1]"
    assert env["SPECDEC_SERVE_CORS_ORIGINS"] == ""


def test_the_load_balancer_limits_request_rates(compose: dict[str, Any]) -> None:
    template = (ROOT / "deploy/nginx/specdec.conf.template").read_text()
    assert "limit_req_zone $binary_remote_addr" in template
    assert "limit_req zone=" in template and "limit_req_status 429;" in template
    # every variable the template names is set by compose (or the upstreams script)
    lb = compose["services"]["lb"]["environment"]
    named = set(re.findall(r"\$\{([A-Z0-9_]+)\}", template))
    assert named - set(lb) == {"SPECDEC_UPSTREAMS"}
    assert int(lb["SPECDEC_LB_RATE"]) >= 100 and int(lb["SPECDEC_LB_BURST"]) >= 100
