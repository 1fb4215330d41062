"""Podman + docker-compose 1.29 on a machine without Docker Hub (``make test-compose``).

* A base image from Debian's mirror: ``debootstrap`` (python3, venv, CA certificates) into a
  cached root file system, then ``podman import``.
* ``containers.conf`` for this kind of host: runc (crun refuses some cgroup layouts) and
  resource limits the host lets a container set (Podman's default raises nofile / nproc, which
  an unprivileged-in-practice root may not do).
* ``podman system service`` on a private socket as the Docker API for docker-compose.
* Healthchecks only run when triggered where there is no systemd: :class:`HealthTrigger` runs
  ``podman healthcheck run`` for the project's containers every couple of seconds.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.waiting import wait_until

BASE_IMAGE = "localhost/specdec-base:bookworm"
ROOTFS = Path(os.environ.get("SPECDEC_ROOTFS_CACHE", "/var/tmp/specdec-rootfs/bookworm"))
MIRROR = os.environ.get("SPECDEC_DEBIAN_MIRROR", "http://deb.debian.org/debian")


def missing_tools() -> list[str]:
    return [t for t in ("podman", "docker-compose", "debootstrap", "runc")
            if shutil.which(t) is None]


class Podman:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        limit = 16384
        for kind in (resource.RLIMIT_NOFILE, resource.RLIMIT_NPROC):
            hard = resource.getrlimit(kind)[1]
            if hard != resource.RLIM_INFINITY:
                limit = min(limit, hard)
        conf = workdir / "containers.conf"
        conf.write_text("[containers]\n"
                        f'default_ulimits = ["nofile={limit}:{limit}", "nproc={limit}:{limit}"]\n'
                        '[engine]\nruntime = "runc"\n')
        self.env = {**os.environ, "CONTAINERS_CONF": str(conf)}
        self.socket = workdir / "podman.sock"

    def run(self, *args: str, timeout: float = 600, check: bool = True,
            stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(["podman", *args], env=self.env, capture_output=True,
                                timeout=timeout, check=False, text=stdin is None,
                                input=stdin)
        if check and result.returncode != 0:
            raise RuntimeError(f"podman {' '.join(args)} failed ({result.returncode}): "
                               f"{str(result.stderr)[-2000:]}")
        return result

    def base_image(self) -> str:
        """The Debian base image, made once (the root file system is cached too)."""
        if self.run("image", "exists", BASE_IMAGE, check=False).returncode == 0:
            return BASE_IMAGE
        if not (ROOTFS / "usr/bin/python3").exists():
            shutil.rmtree(ROOTFS, ignore_errors=True)
            ROOTFS.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(["debootstrap", "--variant=minbase",
                            "--include=python3,python3-venv,ca-certificates", "bookworm",
                            str(ROOTFS), MIRROR], check=True, capture_output=True, timeout=900)
        tar = subprocess.run(["tar", "-C", str(ROOTFS), "-c", "."], check=True,
                             capture_output=True, timeout=300).stdout
        self.run("import", "-", BASE_IMAGE, stdin=tar, timeout=300)
        return BASE_IMAGE

    def build(self, tag: str, context: Path, **build_args: str) -> None:
        args = [f"--build-arg={k}={v}" for k, v in build_args.items()]
        self.run("build", "-t", tag, *args, str(context), timeout=1800)

    @contextmanager
    def service(self) -> Iterator[str]:
        """The Docker API on a private socket; yields DOCKER_HOST."""
        self.socket.unlink(missing_ok=True)
        proc = subprocess.Popen(["podman", "system", "service", "--time=0",
                                 f"unix://{self.socket}"], env=self.env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            def listening() -> bool:
                if proc.poll() is not None:
                    raise RuntimeError("podman system service did not start")
                return self.socket.exists()

            wait_until(listening, timeout_s=30, interval_s=0.1, what="podman's API socket")
            yield f"unix://{self.socket}"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()

    def containers(self, project: str, running_only: bool = False) -> list[str]:
        """The names of a compose project's containers (all, or the running ones)."""
        every = [] if running_only else ["-a"]
        out = self.run("ps", *every, "--filter", f"label=com.docker.compose.project={project}",
                       "--format", "{{.Names}}", check=False).stdout
        return [name for name in str(out).split() if name]


class HealthTrigger:
    """Runs the healthchecks of a compose project's running containers every ``every_s``."""

    def __init__(self, podman: Podman, project: str, every_s: float = 2.0) -> None:
        self.podman, self.project, self.every_s = podman, project, every_s
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stop.wait(self.every_s):
            for name in self.podman.containers(self.project, running_only=True):
                self.podman.run("healthcheck", "run", name, check=False, timeout=30)

    def __enter__(self) -> HealthTrigger:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=60)
