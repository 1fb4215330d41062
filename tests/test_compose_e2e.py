"""`make test-compose`: the real docker-compose.yml, run end to end with Podman + docker-compose.

Builds the image (on a debootstrapped Debian base, torch from a local wheel when the machine has
one), then ``docker compose up`` with the tiny pair in place of the downloaded models: models ->
verifier healthy -> the client's output equals a local run; the gateway answers the ``openai``
package the same; then the ``scale`` profile with 2 replicas behind nginx serves sessions from
both replicas with the same outputs; then everything is torn down. Minutes, not part of
`make test` (marker ``compose``); skipped where the tools are missing.
"""

from __future__ import annotations

import glob
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from drafter_client.api import SpecDecClient
from scripts.harness.process import free_port
from scripts.harness.tiny_models import build_tiny_set
from tests.support.containers import HealthTrigger, Podman, missing_tools
from tests.support.live_server import LiveServer, fp32_settings

ROOT = Path(__file__).resolve().parent.parent
PROJECT = "specdec-compose-test"
PROMPT = "the cat sat"
NEW_TOKENS = 24

pytestmark = [pytest.mark.compose,
              pytest.mark.skipif(bool(missing_tools()),
                                 reason=f"missing: {' '.join(missing_tools())}")]


@pytest.fixture(scope="module")
def podman(tmp_path_factory: pytest.TempPathFactory) -> Podman:
    return Podman(tmp_path_factory.mktemp("podman"))


@pytest.fixture(scope="module")
def models() -> Iterator[Path]:
    """The tiny pair where the containers' user (uid 10001) can read it."""
    root = Path("/var/tmp/specdec-compose-models")
    shutil.rmtree(root, ignore_errors=True)
    paths = build_tiny_set(root)
    subprocess.run(["chmod", "-R", "a+rX", str(root)], check=True)
    yield root
    assert paths  # built


@pytest.fixture(scope="module")
def images(podman: Podman) -> dict[str, str]:
    base = podman.base_image()
    extra = ROOT / "deploy/build-extra"
    (extra / "ca").mkdir(parents=True, exist_ok=True)
    for cert in glob.glob("/usr/local/share/ca-certificates/*.crt"):
        shutil.copy(cert, extra / "ca")
    args = {"BASE_IMAGE": base}
    wheels = glob.glob("/opt/wheels/torch-2.13.0+cpu-*.whl")  # the machine's CPU wheel
    if wheels:
        (extra / "wheels").mkdir(exist_ok=True)
        for wheel in wheels:
            if not (extra / "wheels" / Path(wheel).name).exists():
                shutil.copy(wheel, extra / "wheels")
        args["TORCH_PIP_ARGS"] = "--find-links /tmp/build-extra/wheels"
    podman.build("localhost/specdec:compose-test", ROOT, **args)
    podman.build("localhost/specdec-lb:compose-test", ROOT / "deploy/nginx", BASE_IMAGE=base)
    return {"app": "localhost/specdec:compose-test", "lb": "localhost/specdec-lb:compose-test"}


@pytest.fixture(scope="module")
def reference(models: Path) -> dict[str, str]:
    """The local run: the same tiny pair, a verifier in this process."""
    with LiveServer(fp32_settings(models / "gpt2-target")) as server:
        client = SpecDecClient(server.url, str(models / "gpt2-drafter"))
        return {p: client.generate(p, chat=True, max_new_tokens=NEW_TOKENS).text
                for p in (PROMPT, "a dog ran", "def f ( x ) :")}


class Compose:
    def __init__(self, podman: Podman, docker_host: str, override: Path,
                 env: dict[str, str]) -> None:
        self.podman, self.override = podman, override
        self.env = {**podman.env, "DOCKER_HOST": docker_host, **env}

    def __call__(self, *args: str, timeout: float = 900,
                 extra_env: dict[str, str] | None = None) -> str:
        result = subprocess.run(
            ["docker-compose", "-p", PROJECT, "-f", str(ROOT / "docker-compose.yml"), "-f",
             str(self.override), *args], env={**self.env, **(extra_env or {})},
            capture_output=True, text=True, timeout=timeout, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"docker-compose {' '.join(args)} failed: "
                               f"{result.stderr[-3000:]}")
        return result.stdout


def wait_exit(podman: Podman, name: str, timeout_s: float = 300) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = podman.run("inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}",
                           name, check=False).stdout.split()
        if state and state[0] in ("exited", "stopped"):
            return int(state[1])
        time.sleep(1)
    raise TimeoutError(f"{name} still running after {timeout_s} s")


def test_compose_end_to_end(podman: Podman, images: dict[str, str], models: Path,
                            reference: dict[str, str], tmp_path: Path) -> None:
    mount = [f"{models}:/models:ro"]
    override = tmp_path / "override.yml"
    override.write_text(yaml.safe_dump({"services": {
        "models": {"command": ["ls", "/models/gpt2-target/config.json",
                               "/models/gpt2-drafter/config.json"], "volumes": mount},
        "verifier": {"volumes": mount},
        "client": {"volumes": mount},
        "gateway": {"volumes": mount},
    }}))
    ports = [free_port() for _ in range(3)]
    env = {
        "SPECDEC_IMAGE_TAG": "compose-test", "SPECDEC_LB_IMAGE": images["lb"],
        "SPECDEC_MODEL": "/models/gpt2-target", "SPECDEC_DTYPE": "float32",
        "SPECDEC_DRAFTER": "/models/gpt2-drafter", "SPECDEC_PROMPT": PROMPT,
        "SPECDEC_MAX_NEW_TOKENS_CLIENT": str(NEW_TOKENS), "SPECDEC_THREADS": "1",
        "SPECDEC_VERIFIER_PUBLISH": f"{ports[0]}:8000", "SPECDEC_GATEWAY_HOST_PORT": str(ports[1]),
        "SPECDEC_LB_HOST_PORT": str(ports[2]),
    }
    with podman.service() as docker_host:
        compose = Compose(podman, docker_host, override, env)
        compose("down", "-v", "--remove-orphans", timeout=300)
        try:
            with HealthTrigger(podman, PROJECT):
                # models -> verifier (healthy) -> client, and the OpenAI gateway
                compose("--profile", "openai", "up", "-d")
                client = f"{PROJECT}_client_1"
                assert wait_exit(podman, client) == 0
                logs = podman.run("logs", client).stdout
                assert logs.split("\n--- generate:")[0] == reference[PROMPT], logs
                verifier = f"http://127.0.0.1:{ports[0]}"
                assert httpx.get(verifier + "/readyz").json()["status"] == "ready"
                assert "specdec_verifier_verify_calls_total" in httpx.get(
                    verifier + "/metrics").text
                gateway = f"http://127.0.0.1:{ports[1]}"
                wait_healthy(gateway + "/health")
                oai = openai.OpenAI(base_url=gateway + "/v1", api_key="none", max_retries=0)
                name = oai.models.list().data[0].id
                reply = oai.chat.completions.create(
                    model=name, messages=[{"role": "user", "content": "a dog ran"}],
                    temperature=0, max_tokens=NEW_TOKENS)
                assert reply.choices[0].message.content == reference["a dog ran"]

                # the scale profile: 2 replicas behind nginx, from a clean start (nginx resolves
                # the replicas once, when it starts)
                compose("--profile", "openai", "down", timeout=300)
                compose("--profile", "scale", "up", "-d", "lb",
                        extra_env={"SPECDEC_REPLICAS": "2", "SPECDEC_VERIFIER_PUBLISH": "8000"})
                lb = f"http://127.0.0.1:{ports[2]}"
                wait_healthy(lb + "/lb-healthz")
                wait_healthy(lb + "/readyz")
                # new sessions spread over both replicas (nginx takes a replica out for 10 s
                # after a failed call, e.g. one still loading when the balancer started)
                replicas: set[str] = set()
                failures: list[str] = []
                deadline = time.monotonic() + 90
                with httpx.Client(base_url=lb, timeout=30) as http:
                    i = 0
                    while len(replicas) < 2 and time.monotonic() < deadline:
                        sid = f"compose-{i}"
                        i += 1
                        r = http.post("/v1/sessions", json={"prompt_ids": [2, 3, 4],
                                                            "session_id": sid},
                                      headers={"x-session-id": sid})
                        if r.status_code != 200:
                            failures.append(f"{r.status_code} {r.text[:120]}")
                            time.sleep(1)
                            continue
                        replica = r.headers["x-verifier-replica"]
                        replicas.add(replica)
                        # affinity: the session's next call reaches the replica that holds it
                        gone = http.delete(f"/v1/sessions/{sid}", headers={"x-session-id": sid})
                        assert (gone.status_code, gone.headers["x-verifier-replica"]) == (
                            204, replica)
                if len(replicas) < 2:  # what went wrong, for the failure message
                    status = podman.run("ps", "-a", "--format", "{{.Names}} {{.Status}}",
                                        check=False).stdout
                    lb_logs = podman.run("logs", "--tail", "20", f"{PROJECT}_lb_1",
                                         check=False)
                    conf = podman.run("exec", f"{PROJECT}_lb_1", "cat",
                                      "/etc/nginx/conf.d/specdec.conf", check=False).stdout
                    pytest.fail(f"one replica answered: {replicas}; failed calls: "
                                f"{failures[:3]} ({len(failures)})\n{status}\n"
                                f"{lb_logs.stdout[-2000:]}{lb_logs.stderr[-2000:]}\n{conf}")
                balanced = SpecDecClient(lb, str(models / "gpt2-drafter"))
                for prompt in ("def f ( x ) :", PROMPT):
                    result = balanced.generate(prompt, chat=True, max_new_tokens=NEW_TOKENS)
                    assert result.text == reference[prompt]
                    assert result.metrics.session_reopens == 0  # no call missed its replica
        finally:
            compose("--profile", "scale", "--profile", "openai", "down", "-v",
                    "--remove-orphans", timeout=300)
        assert podman.containers(PROJECT) == []


def wait_healthy(url: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not healthy after {timeout_s} s")
        time.sleep(1)

