"""`make test-compose`: the real docker-compose.yml, run end to end with Podman + docker-compose.

Builds the image (on a debootstrapped Debian base, torch from a local wheel when the machine has
one, llama.cpp built in its own stage), then ``docker compose up`` with a tiny Q4_K_M pair (the
kernels of a real GGUF file, logits near uniform so a rounding difference changes a greedy token)
in place of the downloaded models, on the image's default engine (auto: w4a8, its kernels
built in the image's build stage, no compiler at run time):
models -> verifier healthy -> the client's greedy output equals the same request on a verifier on
this host; the gateway answers the official ``openai`` package the same; then the ``scale``
profile with 2 replicas behind nginx keeps each session on its replica, and a replica stopped
while a client generates: the generation finishes on the other one (its session reopened) with
the same output. Then everything is torn down. Also: the gpu profile's LLAMA_CMAKE_ARGS reach
llama.cpp's CMake. Cold start and first-generation times are printed. Minutes, not part of
`make test` (marker ``compose``); skipped where the tools are missing.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from drafter_client.api import SpecDecClient
from drafter_client.settings import ClientSettings
from drafter_client.speculative import GenerationResult
from tests.support.containers import HealthTrigger, Podman, missing_tools
from tests.support.live_server import LiveServer
from tests.support.tiny_gguf import save_quantized_gguf
from tests.support.waiting import wait_until
from verifier_service.launch import free_port
from verifier_service.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
PROJECT = "specdec-compose-test"
PROMPT = "the cat sat"
NEW_TOKENS = 24
LONG = 120  # the generation a replica is stopped under
CONTEXT = 256
TARGET, DRAFTER = "target/model-q4_k_m.gguf", "drafter/model-q4_k_m.gguf"

pytestmark = [pytest.mark.compose,
              pytest.mark.skipif(bool(missing_tools()),
                                 reason=f"missing: {' '.join(missing_tools())}")]


@pytest.fixture(scope="module")
def podman(tmp_path_factory: pytest.TempPathFactory) -> Podman:
    return Podman(tmp_path_factory.mktemp("podman"))


@pytest.fixture(scope="module")
def models() -> Path:
    """The tiny Q4_K_M pair, with tokenizers, where the containers' user (uid 10001) can read
    it."""
    root = Path("/var/tmp/specdec-compose-models")
    shutil.rmtree(root, ignore_errors=True)
    save_quantized_gguf(root / "target", seed=0)
    save_quantized_gguf(root / "drafter", seed=1)
    subprocess.run(["chmod", "-R", "a+rX", str(root)], check=True)
    return root


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


def host_settings(models: Path) -> Settings:
    """The compose verifier's settings, on this host."""
    return Settings(model=str(models / TARGET), engine="w4a8", threads=1,
                    max_context=CONTEXT)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def reference(models: Path) -> dict[tuple[str, int], str]:
    """The same requests on this host: the pair on a w4a8 verifier in this process (its bits
    are the same on every kernel path, so the image's path need not be this host's)."""
    with LiveServer(host_settings(models)) as server:
        client = SpecDecClient(server.url, str(models / DRAFTER))
        return {(p, n): client.generate(p, chat=True, max_new_tokens=n).text
                for p, n in ((PROMPT, NEW_TOKENS), ("a dog ran", NEW_TOKENS),
                             ("def f ( x ) :", NEW_TOKENS), (PROMPT, LONG))}


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
    def exit_code() -> list[int]:
        state = podman.run("inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}",
                           name, check=False).stdout.split()
        return [int(state[1])] if state and state[0] in ("exited", "stopped") else []

    [code] = wait_until(exit_code, timeout_s=timeout_s, interval_s=1, what=f"{name}'s exit")
    return code


def replica_port(podman: Podman, name: str) -> int:
    """The host port a replica's 8000 is published on (an ephemeral one with replicas)."""
    out = podman.run("port", name, "8000").stdout.strip().splitlines()[0]
    return int(out.rsplit(":", 1)[1])


def test_compose_end_to_end(podman: Podman, images: dict[str, str], models: Path,
                            reference: dict[tuple[str, int], str], tmp_path: Path) -> None:
    mount = [f"{models}:/models:ro"]
    override = tmp_path / "override.yml"
    override.write_text(yaml.safe_dump({"services": {
        "models": {"command": ["ls", f"/models/{TARGET}", f"/models/{DRAFTER}"],
                   "volumes": mount},
        "verifier": {"volumes": mount},
        "client": {"volumes": mount},
        "gateway": {"volumes": mount},
    }}))
    ports = [free_port() for _ in range(3)]
    env = {
        # the engine is left to the image's default (auto)
        "SPECDEC_IMAGE_TAG": "compose-test", "SPECDEC_LB_IMAGE": images["lb"],
        "SPECDEC_MODEL": f"/models/{TARGET}", "SPECDEC_MAX_CONTEXT": str(CONTEXT),
        "SPECDEC_DRAFTER": f"/models/{DRAFTER}", "SPECDEC_PROMPT": PROMPT,
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
                started = time.perf_counter()
                compose("--profile", "openai", "up", "-d")
                verifier = f"http://127.0.0.1:{ports[0]}"
                wait_healthy(verifier + "/readyz")
                ready_s = time.perf_counter() - started
                info = httpx.get(verifier + "/v1/info").json()
                # the w4a8 engine ran the file, on the kernels the image carries
                assert info["engine"] == "w4a8" and info["dtype"].startswith("gguf w4a8"), info
                assert info["kernels"] == "exact", info
                client = f"{PROJECT}_client_1"
                assert wait_exit(podman, client) == 0
                generated_s = time.perf_counter() - started
                logs = podman.run("logs", client).stdout
                assert logs.split("\n--- generate:")[0] == reference[PROMPT, NEW_TOKENS], logs
                print(f"\ncold start: compose up -> verifier /readyz {ready_s:.1f} s, -> the "
                      f"client's first generation done {generated_s:.1f} s")
                assert "specdec_verifier_verify_calls_total" in httpx.get(
                    verifier + "/metrics").text
                gateway = f"http://127.0.0.1:{ports[1]}"
                wait_healthy(gateway + "/health")
                oai = openai.OpenAI(base_url=gateway + "/v1", api_key="none", max_retries=0)
                name = oai.models.list().data[0].id
                reply = oai.chat.completions.create(
                    model=name, messages=[{"role": "user", "content": "a dog ran"}],
                    temperature=0, max_tokens=NEW_TOKENS)
                assert reply.choices[0].message.content == reference["a dog ran", NEW_TOKENS]

                # the scale profile: 2 replicas behind nginx, from a clean start (nginx resolves
                # the replicas once, when it starts)
                compose("--profile", "openai", "down", timeout=300)
                compose("--profile", "scale", "up", "-d", "lb",
                        extra_env={"SPECDEC_REPLICAS": "2", "SPECDEC_VERIFIER_PUBLISH": ":8000"})
                lb = f"http://127.0.0.1:{ports[2]}"
                wait_healthy(lb + "/lb-healthz")
                wait_healthy(lb + "/readyz")
                check_affinity(podman, lb)
                balanced = SpecDecClient(lb, str(models / DRAFTER))
                for prompt in ("def f ( x ) :", PROMPT):
                    result = balanced.generate(prompt, chat=True, max_new_tokens=NEW_TOKENS)
                    assert result.text == reference[prompt, NEW_TOKENS]
                    assert result.metrics.session_reopens == 0  # no call missed its replica
                stop_a_replica_mid_run(podman, lb, models, reference[PROMPT, LONG])
        finally:
            compose("--profile", "scale", "--profile", "openai", "down", "-v",
                    "--remove-orphans", timeout=300)
        assert podman.containers(PROJECT) == []


def check_affinity(podman: Podman, lb: str) -> None:
    """New sessions spread over both replicas, and each session's next call reaches the
    replica that holds it (nginx takes a replica out for 10 s after a failed call, e.g. one
    still loading when the balancer started)."""
    replicas: set[str] = set()
    failures: list[str] = []
    sids = (f"compose-{i}" for i in itertools.count())
    with httpx.Client(base_url=lb, timeout=30) as http:
        def spread() -> bool:
            """Up to 20 new sessions, until both replicas have answered; a failed call ends the
            round (the next comes after the poll interval)."""
            for sid in itertools.islice(sids, 20):
                r = http.post("/v1/sessions", json={"prompt_ids": [2, 3, 4], "session_id": sid},
                              headers={"x-session-id": sid})
                if r.status_code != 200:
                    failures.append(f"{r.status_code} {r.text[:120]}")
                    return False
                replica = r.headers["x-verifier-replica"]
                replicas.add(replica)
                gone = http.delete(f"/v1/sessions/{sid}", headers={"x-session-id": sid})
                assert (gone.status_code, gone.headers["x-verifier-replica"]) == (204, replica)
                if len(replicas) == 2:
                    return True
            return False

        with contextlib.suppress(TimeoutError):
            wait_until(spread, timeout_s=90, interval_s=1, what="both replicas answering")
    if len(replicas) < 2:  # what went wrong, for the failure message
        status = podman.run("ps", "-a", "--format", "{{.Names}} {{.Status}}",
                            check=False).stdout
        lb_logs = podman.run("logs", "--tail", "20", f"{PROJECT}_lb_1", check=False)
        conf = podman.run("exec", f"{PROJECT}_lb_1", "cat", "/etc/nginx/conf.d/specdec.conf",
                          check=False).stdout
        pytest.fail(f"one replica answered: {replicas}; failed calls: {failures[:3]} "
                    f"({len(failures)})\n{status}\n{lb_logs.stdout[-2000:]}"
                    f"{lb_logs.stderr[-2000:]}\n{conf}")


def stop_a_replica_mid_run(podman: Podman, lb: str, models: Path, want: str) -> None:
    """A client generates through the balancer (each call 100 ms slower, so the run lasts
    seconds); the replica holding its session is stopped under it. The generation must finish
    on the other replica, its session reopened there, with the output of an undisturbed run."""
    names = [f"{PROJECT}_verifier_{i}" for i in (1, 2)]
    urls = {name: f"http://127.0.0.1:{replica_port(podman, name)}" for name in names}
    client = SpecDecClient(lb, str(models / DRAFTER),
                           settings=ClientSettings(simulated_rtt_ms=100.0))
    results: list[GenerationResult | BaseException] = []

    def generate() -> None:
        try:
            results.append(client.generate(PROMPT, chat=True, max_new_tokens=LONG))
        except BaseException as exc:  # noqa: BLE001 - reported below
            results.append(exc)

    thread = threading.Thread(target=generate)
    thread.start()
    def metrics(name: str) -> dict[str, Any]:
        return httpx.get(urls[name] + "/v1/metrics", timeout=5).json()  # type: ignore[no-any-return]

    def holding() -> str | None:
        assert thread.is_alive(), f"no replica held the session: {results}"
        return next((name for name in names if metrics(name)["sessions"] > 0), None)

    holder = wait_until(holding, timeout_s=60, interval_s=0.05, what="a replica holding it")
    calls = metrics(holder)["verify_calls"]
    wait_until(lambda: metrics(holder)["verify_calls"] >= calls + 3 or not thread.is_alive(),
               timeout_s=60, what="a few blocks in")
    assert thread.is_alive(), "the generation ended before the replica was stopped"
    podman.run("stop", "-t", "2", holder)
    thread.join(120)
    [result] = results
    assert not isinstance(result, BaseException), repr(result)
    assert result.metrics.session_reopens >= 1  # it did move
    assert result.text == want
    print(f"stopped {holder} mid-run: the generation finished on the other replica "
          f"({result.metrics.session_reopens} reopen)")


def wait_healthy(url: str, timeout_s: float = 180) -> None:
    wait_until(lambda: httpx.get(url, timeout=5).status_code == 200, timeout_s=timeout_s,
               interval_s=1, what=f"{url} answering 200", ignoring=(httpx.HTTPError,))



def test_gpu_profile_build_arguments_reach_llama_cpp(podman: Podman, tmp_path: Path) -> None:
    """The gpu profile's build as far as a machine without CUDA goes: compose renders its build
    arguments, and its LLAMA_CMAKE_ARGS reach llama.cpp's CMake, which then asks for the CUDA
    toolkit (this base image has none). The negative control: the same stage without the
    argument gets past that point."""
    rendered = yaml.safe_load(subprocess.run(
        ["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "--profile", "gpu",
         "config"], capture_output=True, text=True, check=True, timeout=60,
        env={k: v for k, v in podman.env.items() if not k.startswith("SPECDEC_")}).stdout)
    args = rendered["services"]["verifier-gpu"]["build"]["args"]
    assert args["LLAMA_CMAKE_ARGS"] == "-DGGML_CUDA=on" and args["TORCH_VARIANT"] == "cu126"
    assert rendered["services"]["models-gpu"]["build"]["args"] == args
    base = podman.base_image()
    built = podman.run("build", "--target", "llama", f"--build-arg=BASE_IMAGE={base}",
                       f"--build-arg=LLAMA_CMAKE_ARGS={args['LLAMA_CMAKE_ARGS']}",
                       "-t", "localhost/specdec-llama-cuda:compose-test", str(ROOT),
                       check=False, timeout=1800)
    output = built.stdout + built.stderr
    assert built.returncode != 0, output[-3000:]
    assert "-DGGML_CUDA=on" in output and "CUDA Toolkit not found" in output, output[-3000:]
    # the CPU stage, built by the images fixture or here (cached): the argument made the failure
    plain = podman.run("build", "--target", "llama", f"--build-arg=BASE_IMAGE={base}", "-t",
                       "localhost/specdec-llama:compose-test", str(ROOT), check=False,
                       timeout=1800)
    assert plain.returncode == 0, plain.stderr[-3000:]
