"""The compose file's nginx config, for real: two verifier processes behind nginx on loopback.

Every call of a session must land on the replica that holds its KV cache, new sessions must
spread over both, and a greedy generation through the balancer must equal one against a single
verifier. Skipped where nginx is not installed (`make test` installs it when it can).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from drafter_client import SpecDecClient
from shared.protocol.schema import REPLICA_HEADER, SESSION_HEADER
from verifier_service.launch import free_port, wait_ready

ROOT = Path(__file__).resolve().parents[1]
NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
pytestmark = [pytest.mark.nginx,
              pytest.mark.skipif(NGINX is None, reason="nginx is not installed")]


def lb_defaults() -> dict[str, str]:
    """The load balancer's variables as compose sets them, with nothing set here."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    env = compose["services"]["lb"]["environment"]
    return {name: re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", str(value))
            for name, value in env.items()}


def render_site(upstreams: str, listen: str, **values: str) -> str:
    """deploy/nginx/specdec.conf.template as the image's entrypoint renders it: compose's
    variables, then ``values`` over them."""
    site = (ROOT / "deploy/nginx/specdec.conf.template").read_text()
    variables = {**lb_defaults(), "SPECDEC_UPSTREAMS": upstreams, "SPECDEC_LB_PORT": listen,
                 **values}
    for name, value in variables.items():
        site = site.replace("${" + name + "}", value)
    left = re.findall(r"\$\{[A-Z0-9_]+\}", site)
    assert not left, f"variables compose does not set: {left}"
    return site


@contextlib.contextmanager
def run_nginx(root: Path, site: str) -> Iterator[subprocess.Popen[bytes]]:
    """nginx with ``site`` in its http block, in ``root`` (its process; wait for it to
    answer)."""
    (root / "logs").mkdir()
    (root / "nginx.conf").write_text(
        f"pid {root}/nginx.pid;\nerror_log {root}/logs/error.log;\nworker_processes 1;\n"
        "events { worker_connections 256; }\n"
        f"http {{\n  access_log {root}/logs/access.log;\n"
        f"  client_body_temp_path {root}/body;\n  proxy_temp_path {root}/proxy;\n"
        f"  fastcgi_temp_path {root}/fcgi;\n  uwsgi_temp_path {root}/uwsgi;\n"
        f"  scgi_temp_path {root}/scgi;\n{site}\n}}\n")
    nginx = subprocess.Popen([str(NGINX), "-p", str(root), "-c", str(root / "nginx.conf"),
                              "-g", "daemon off;"], stderr=subprocess.PIPE)
    try:
        yield nginx
    finally:
        if nginx.poll() is None:
            nginx.terminate()
        nginx.wait(timeout=30)


@contextlib.contextmanager
def nginx_cluster(model: Path, root: Path, args: tuple[str, ...] = ("--dtype", "float32",
                                                                    "--device", "cpu"),
                  ) -> Iterator[tuple[dict[str, str], dict[str, subprocess.Popen[bytes]]]]:
    """Two verifier replicas of ``model`` (with ``args``) behind nginx with the project's
    config: (urls by name and "lb", processes by name)."""
    procs: dict[str, subprocess.Popen[bytes]] = {}
    urls: dict[str, str] = {}
    for name in ("replica-a", "replica-b"):
        port = free_port()
        procs[name] = subprocess.Popen(
            [str(Path(sys.executable).parent / "specdec-verifier"), "--model", str(model),
             *args, "--port", str(port), "--threads", "1", "--replica-name", name],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        urls[name] = f"http://127.0.0.1:{port}"
    lb_port = free_port()
    upstreams = " ".join(f"server {u.removeprefix('http://')};" for u in urls.values())
    try:
        with run_nginx(root, render_site(upstreams, f"127.0.0.1:{lb_port}")) as nginx:
            for name in ("replica-a", "replica-b"):
                wait_ready(urls[name], procs[name])
            urls["lb"] = f"http://127.0.0.1:{lb_port}"
            wait_ready(urls["lb"], nginx, path="/lb-healthz")
            yield urls, procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            proc.wait(timeout=30)


def test_the_balancer_limits_each_addresss_request_rate(tmp_path: Path) -> None:
    """A flood from one address gets 429 with Retry-After (which the client retries) once
    past the burst; the health probe is never limited. No verifier: the calls that pass get
    nginx's 502."""
    port, nowhere = free_port(), free_port()
    site = render_site(f"server 127.0.0.1:{nowhere};", f"127.0.0.1:{port}",
                       SPECDEC_LB_RATE="1", SPECDEC_LB_BURST="3")
    with run_nginx(tmp_path, site) as nginx, httpx.Client(
            base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
        wait_ready(f"http://127.0.0.1:{port}", nginx, path="/lb-healthz")
        answers = [http.get("/v1/info") for _ in range(12)]
        assert [a.status_code for a in answers[:4]] == [502] * 4  # the burst passes
        limited = [a for a in answers if a.status_code == 429]
        assert len(limited) >= 6
        assert limited[0].headers["retry-after"] == "1"
        assert limited[0].json()["error"]["code"] == "rate_limited"
        assert all(http.get("/lb-healthz").status_code == 200 for _ in range(10))


def test_the_default_rate_lets_a_client_through(tmp_path: Path) -> None:
    """Negative control: the same flood at compose's default rate is never limited."""
    port, nowhere = free_port(), free_port()
    site = render_site(f"server 127.0.0.1:{nowhere};", f"127.0.0.1:{port}")
    with run_nginx(tmp_path, site) as nginx, httpx.Client(
            base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
        wait_ready(f"http://127.0.0.1:{port}", nginx, path="/lb-healthz")
        assert {http.get("/v1/info").status_code for _ in range(12)} == {502}


@pytest.fixture(scope="module")
def cluster(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[dict[str, str]]:
    with nginx_cluster(tiny_models["gpt2-target"], tmp_path_factory.mktemp("nginx")) as (urls,
                                                                                        _):
        yield urls


def test_sessions_stick_to_one_replica_and_spread(cluster: dict[str, str]) -> None:
    seen: dict[str, str] = {}
    with httpx.Client(base_url=cluster["lb"], timeout=30) as http:
        for i in range(16):
            sid = f"session-{i:04d}-abcdef"
            headers = {SESSION_HEADER: sid}
            created = http.post("/v1/sessions", json={"prompt_ids": [2, 3, 4], "session_id": sid},
                                headers=headers)
            assert created.status_code == 200, created.text
            replica = created.headers[REPLICA_HEADER]
            position = 3
            for _ in range(3):
                reply = http.post(f"/v1/sessions/{sid}/verify", headers=headers, json={
                    "position": position, "last_token": 5, "draft_ids": [6, 7],
                    "log_uniforms": [-0.5, -0.5], "final_uniform": 0.5})
                assert reply.status_code == 200, reply.text  # a wrong replica would answer 404
                assert reply.headers[REPLICA_HEADER] == replica
                position = reply.json()["position"]
            gone = http.delete(f"/v1/sessions/{sid}", headers=headers)
            assert gone.status_code == 204 and gone.headers[REPLICA_HEADER] == replica
            seen[sid] = replica
    assert set(seen.values()) == {"replica-a", "replica-b"}  # new sessions spread over both


def test_greedy_through_the_balancer_equals_a_single_verifier(
        cluster: dict[str, str], tiny_models: dict[str, Path]) -> None:
    drafter = str(tiny_models["gpt2-drafter"])
    direct = SpecDecClient(cluster["replica-a"], drafter, dtype="float32", device="cpu")
    balanced = SpecDecClient(cluster["lb"], drafter, dtype="float32", device="cpu")
    for i, prompt in enumerate(["the cat sat on", "def x ( y ) :", "a big red dog"]):
        expected = direct.generate(prompt, num_draft_tokens=3, max_new_tokens=20).token_ids
        for _ in range(2):  # fresh sessions, likely on both replicas
            got = balanced.generate(prompt, num_draft_tokens=3, max_new_tokens=20).token_ids
            assert got == expected, f"prompt {i}"


def exact_target(engine: str, root: Path) -> tuple[Path, tuple[str, ...], str]:
    """A tiny target on an exact CPU engine: (model, verifier arguments, tokenizer folder)."""
    from tests.support.tiny_gguf import save_quantized_gguf
    from tests.support.tiny_models import save_tiny_qwen2

    common = ("--engine", engine, "--max-context", "256", "--max-draft-tokens", "8")
    if engine == "llama-cpp":
        gguf = save_quantized_gguf(root / "q4k", seed=0)
        return gguf, common, str(gguf.parent)
    qwen2 = save_tiny_qwen2(root / "qwen2", 256)
    return qwen2, common, str(qwen2)


@pytest.mark.slow  # two replicas and nginx per engine
@pytest.mark.parametrize("engine", ["transformers", "llama-cpp", "int8"])
def test_a_replica_killed_mid_generation_fails_over_with_identical_output(
        engine: str, tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """kill -9 of the replica holding the session, mid-generation: nginx answers 502 (retried),
    then routes the session to the other replica, which does not know it (404); the client
    reopens it there with its committed tokens and finishes with the undisturbed output. On
    the exact CPU engines (a Q4_K_M file on llama.cpp's exact kernels, int8) with the n-gram
    drafter, equal to the target alone's (llama.cpp writes the reopened tokens in its steps'
    layout; the naive reopen's negative control is tests/test_reopen_exact.py's)."""
    if engine == "transformers":
        model, args = tiny_models["gpt2-target"], ("--dtype", "float32", "--device", "cpu")
        drafter, options, prompt = str(tiny_models["gpt2-drafter"]), {"dtype": "float32"}, \
            "the cat sat on"
    else:
        model, args, tokenizer = exact_target(engine, tmp_path / "model")
        drafter, options, prompt = "ngram", {"tokenizer": tokenizer}, \
            [int(t) for t in range(7, 90, 7)]
    with nginx_cluster(model, tmp_path, args) as (urls, procs):
        direct = SpecDecClient(urls["replica-a"], drafter, **options)  # type: ignore[arg-type]
        expected = (direct.generate(prompt, num_draft_tokens=2, max_new_tokens=30)
                    if engine == "transformers" else direct.baseline(prompt, max_new_tokens=30)
                    ).token_ids
        client = SpecDecClient(urls["lb"], drafter, retry_budget_s=60,
                               **options)  # type: ignore[arg-type]
        killed: list[str] = []

        def kill_the_holder(_: list[int]) -> None:  # after the first block
            if killed:
                return
            for name in ("replica-a", "replica-b"):
                if httpx.get(f"{urls[name]}/v1/metrics").json()["sessions"]:
                    procs[name].kill()
                    procs[name].wait()
                    killed.append(name)
                    return

        result = client.generate(prompt, num_draft_tokens=2, max_new_tokens=30,
                                 on_tokens=kill_the_holder)
        survivor = next(n for n in ("replica-a", "replica-b") if n not in killed)
        served = httpx.get(f"{urls[survivor]}/v1/metrics").json()
    assert killed, "no replica held the session"
    assert result.token_ids == expected
    assert result.metrics.session_reopens >= 1 and served["verify_calls"] > 0
