"""Two network namespaces joined by a veth pair: a real network between client and verifier.

The verifier side (``srv``, 10.213.X.1) and the client side (``cli``, 10.213.X.2) talk over the
veth pair only. Impairments are applied to packets leaving the verifier side:

  * with ``tc netem`` (Debian's iproute2, kernel module sch_netem): delay and loss on the veth;
  * where the kernel has no netem (some VMs), loss comes from an nftables rule
    (``numgen random``) on the same interface, and delay from :mod:`tests.support.fault_proxy`
    running in the verifier's namespace in front of the verifier (``delay_via_proxy``).

Needs root (CAP_NET_ADMIN). ``available()`` says whether this machine can do it.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root for ip netns"
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    name = f"sdprobe{secrets.token_hex(3)}"
    probe = _run("ip", "netns", "add", name, check=False)
    if probe.returncode != 0:
        return f"ip netns add failed: {probe.stderr.strip()}"
    _run("ip", "netns", "del", name, check=False)
    return None


def netem_available() -> bool:
    """Can this kernel attach a netem qdisc? Probed on a dummy veth in a scratch namespace."""
    name = f"sdnetem{secrets.token_hex(3)}"
    if _run("ip", "netns", "add", name, check=False).returncode != 0:
        return False
    try:
        _run("ip", "-n", name, "link", "set", "lo", "up", check=False)
        return _run("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root",
                    "netem", "delay", "1ms", check=False).returncode == 0
    finally:
        _run("ip", "netns", "del", name, check=False)


def nft_available() -> bool:
    return shutil.which("nft") is not None


@dataclass
class NetPair:
    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    subnet: int = field(default_factory=lambda: 1 + secrets.randbelow(250))
    delay_via_proxy: bool = False  # True when netem is missing: add delay with the fault proxy

    @property
    def srv(self) -> str:
        return f"sdsrv{self.tag}"

    @property
    def cli(self) -> str:
        return f"sdcli{self.tag}"

    @property
    def srv_ip(self) -> str:
        return f"10.213.{self.subnet}.1"

    @property
    def cli_ip(self) -> str:
        return f"10.213.{self.subnet}.2"

    @property
    def srv_dev(self) -> str:
        return f"vs{self.tag}"

    def exec_prefix(self, side: str) -> list[str]:
        return ["ip", "netns", "exec", self.srv if side == "srv" else self.cli]

    def create(self) -> NetPair:
        cli_dev = f"vc{self.tag}"
        _run("ip", "netns", "add", self.srv)
        _run("ip", "netns", "add", self.cli)
        _run("ip", "link", "add", self.srv_dev, "type", "veth", "peer", "name", cli_dev)
        _run("ip", "link", "set", self.srv_dev, "netns", self.srv)
        _run("ip", "link", "set", cli_dev, "netns", self.cli)
        for ns, dev, ip in ((self.srv, self.srv_dev, self.srv_ip),
                            (self.cli, cli_dev, self.cli_ip)):
            _run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            _run("ip", "-n", ns, "link", "set", dev, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        return self

    def impair(self, delay_ms: float, loss_pct: float) -> str:
        """Delay and drop packets leaving the verifier side; returns how it was done."""
        self.delay_via_proxy = False
        if netem_available():
            args = ["delay", f"{delay_ms}ms"] if delay_ms else []
            args += ["loss", f"{loss_pct}%"] if loss_pct else []
            if args:
                _run("ip", "netns", "exec", self.srv, "tc", "qdisc", "replace", "dev",
                     self.srv_dev, "root", "netem", *args)
            return "tc netem"
        if loss_pct:
            if not nft_available():
                raise RuntimeError("no netem and no nft: cannot drop packets")
            ruleset = (f"table inet specdec_loss {{\n chain out {{\n  type filter hook output "
                       f"priority 0;\n  oifname \"{self.srv_dev}\" numgen random mod 10000 < "
                       f"{int(loss_pct * 100)} drop\n }}\n}}\n")
            subprocess.run(["ip", "netns", "exec", self.srv, "nft", "-f", "-"],
                           input=ruleset, text=True, check=True, capture_output=True)
        self.delay_via_proxy = bool(delay_ms)
        return "nftables loss + proxy delay (this kernel has no netem)"

    def serve(self, verifier_args: list[str], delay_ms: float, port: int = 8000,
              ready_timeout_s: float = 300) -> tuple[list[subprocess.Popen[bytes]], str]:
        """Start ``specdec-verifier`` in the verifier namespace (behind the delay proxy when
        netem is missing); return the processes and the URL the client side uses."""
        procs: list[subprocess.Popen[bytes]] = []
        bind = "127.0.0.1" if self.delay_via_proxy else self.srv_ip
        inner = port + 1 if self.delay_via_proxy else port
        procs.append(subprocess.Popen(
            [*self.exec_prefix("srv"), str(BIN / "specdec-verifier"), "--host", bind,
             "--port", str(inner), *verifier_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        if self.delay_via_proxy:
            procs.append(subprocess.Popen(
                [*self.exec_prefix("srv"), sys.executable, "-m", "tests.support.fault_proxy",
                 "--listen", f"{self.srv_ip}:{port}", "--upstream",
                 f"http://127.0.0.1:{inner}", "--delay-ms", str(delay_ms)],
                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        url = f"http://{self.srv_ip}:{port}"
        waited = subprocess.run([*self.exec_prefix("cli"), sys.executable, "-m",
                                 "verifier_service.launch", "wait-ready", url,
                                 str(ready_timeout_s)], cwd=ROOT, check=False)
        if waited.returncode != 0:
            stop(procs)
            raise RuntimeError(f"the verifier in {self.srv} did not become ready at {url}")
        return procs, url

    def client(self, args: list[str], timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
        """Run the ``specdec`` CLI in the client namespace."""
        return subprocess.run([*self.exec_prefix("cli"), str(BIN / "specdec"), *args],
                              capture_output=True, text=True, timeout=timeout_s, check=False)

    def client_runs(self, runs: list[list[str]], timeout_s: float = 600
                    ) -> list[subprocess.CompletedProcess[str]]:
        """Several ``specdec`` CLI runs in the client namespace, one after another in one
        process (``tests.support.cli_runs``): one process start instead of one a run."""
        from tests.support.cli_runs import answers

        done = subprocess.run([*self.exec_prefix("cli"), sys.executable, "-m",
                               "tests.support.cli_runs"], cwd=ROOT,
                              input="".join(json.dumps(args) + "\n" for args in runs),
                              capture_output=True, text=True, timeout=timeout_s, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"tests.support.cli_runs failed: {done.stderr[-3000:]}")
        return answers(done.stdout, runs)

    def destroy(self) -> None:
        _run("ip", "netns", "del", self.srv, check=False)  # takes the veth pair with it
        _run("ip", "netns", "del", self.cli, check=False)

    def __enter__(self) -> NetPair:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.destroy()


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
