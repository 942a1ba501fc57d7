"""Two hosts on one Linux machine: two network namespaces joined by a veth pair, optionally shaped by `tc`.

Each namespace has its own network stack (interfaces, addresses, routes, ports), so processes started in them talk
as two machines on one Ethernet segment would, over 198.18.0.1 <-> 198.18.0.2 (RFC 2544's benchmarking range
198.18.0.0/15, which no real network routes), never over loopback. The multi-host tests (tests/test_two_hosts.py:
parity across "machines", a cut link) and the slow-network benchmark (bench/compression_netem.py: a 100 Mbit/s
link) both stand on this one harness.

Shaping: `tc qdisc ... netem rate R [delay D]` on each end's egress; kernels without `sch_netem` get a token-bucket
filter (`tbf`), which shapes the rate but cannot add delay. Names carry the creating process's pid and a random
suffix, so parallel runs never collide; `close()` kills every process started here (their process groups, then
whatever is still in the namespaces, by pid) and deletes the namespaces, which destroys the veth pair with them.
Needs root and iproute2; `why_not()` says why it cannot run, for a test to skip with that reason.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
from pathlib import Path

__all__ = ["ADDRS", "VethPair", "why_not"]

ADDRS = ("198.18.0.1", "198.18.0.2")  # RFC 2544 benchmarking range (198.18.0.0/15): routed nowhere


def why_not() -> str | None:
    """Why two namespaces cannot be made on this machine (None when they can, as far as can be told early)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux-only (this is {sys.platform})"
    if shutil.which("ip") is None:
        return "iproute2's `ip` command is not installed"
    if os.geteuid() != 0:
        return f"creating network namespaces needs root (euid {os.geteuid()})"
    return None


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=30, check=check)


class VethPair:
    """Two namespaces ("hosts") joined by a veth pair, ADDRS[0]/24 and ADDRS[1]/24, lo up in each."""

    def __init__(self, prefix: str = "sw") -> None:
        tag = f"{prefix}{os.getpid() % 100000}{secrets.token_hex(2)}"
        if len(tag) > 14:  # interface names stop at 15 characters, and one letter is added
            raise ValueError(f"prefix={prefix!r} is too long: names must stay within 14 characters ({tag!r})")
        self.ns = (f"{tag}a", f"{tag}b")
        self.veth = (f"{tag}x", f"{tag}y")
        self.procs: list[subprocess.Popen] = []
        self.qdisc = ""

    def create(self) -> None:
        """Make the namespaces and the link; raises CalledProcessError (with ip's message) when it cannot."""
        for ns in self.ns:
            _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", self.veth[0], "netns", self.ns[0], "type", "veth", "peer", "name", self.veth[1],
             "netns", self.ns[1])
        for ns, veth, addr in zip(self.ns, self.veth, ADDRS):
            _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "link", "set", veth, "up")

    def shape(self, rate: str, delay_ms: float = 0.0) -> str:
        """Shape both ends' egress to `rate` (tc syntax: "100mbit") plus `delay_ms`; returns the qdisc used."""
        for ns, veth in zip(self.ns, self.veth):
            qdisc = ["netem", "rate", rate] + (["delay", f"{delay_ms}ms"] if delay_ms else [])
            shaped = _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", veth, "root", *qdisc, check=False)
            if shaped.returncode != 0:
                if delay_ms:
                    raise RuntimeError(f"tc netem is not available here ({shaped.stderr.strip()}), and only netem "
                                       f"adds delay: use delay_ms=0 (a token-bucket filter shapes the rate)")
                qdisc = ["tbf", "rate", rate, "burst", "256kb", "latency", "100ms"]
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", veth, "root", *qdisc)
            self.qdisc = " ".join(qdisc)
        return self.qdisc

    def sent_bytes(self, node: int) -> int:
        """Bytes node `node` has sent over its end of the link (the kernel's counter)."""
        shown = _run("ip", "-n", self.ns[node], "-s", "-j", "link", "show", "dev", self.veth[node])
        return int(json.loads(shown.stdout)[0]["stats64"]["tx"]["bytes"])

    def cut(self) -> None:
        """Take node 0's end of the link down: from then on no packet crosses between the hosts."""
        _run("ip", "-n", self.ns[0], "link", "set", self.veth[0], "down")

    def exec(self, node: int, cmd: list[str], *, env: dict[str, str], log: Path, cwd: Path | None = None
             ) -> subprocess.Popen:
        """Start `cmd` in namespace `node` in its own session (so `close` can kill its whole process group), with
        stdout and stderr into `log`."""
        with open(log, "wb") as out:  # the child holds its own descriptor
            proc = subprocess.Popen(["ip", "netns", "exec", self.ns[node], *cmd], env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        """Kill every process started here (their process groups) and whatever still runs in the namespaces."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for ns in self.ns:  # a process that left its session would still be in our namespace: end it by pid
            listed = _run("ip", "netns", "pids", ns, check=False)
            for pid in listed.stdout.split() if listed.returncode == 0 else []:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass

    def close(self) -> None:
        """Stop the processes, then delete the namespaces; deleting one destroys the veth pair with it."""
        try:
            self.stop()
        finally:
            for ns in self.ns:
                _run("ip", "netns", "delete", ns, check=False)
