"""Two hosts on one machine: two Linux network namespaces joined by a veth pair, one torchrun "node" in each.

Each namespace has its own network stack (interfaces, addresses, routes, ports), so two torchrun agents in two
namespaces talk exactly as two machines on one Ethernet segment would: over 198.18.0.1 <-> 198.18.0.2 (RFC 2544's
benchmarking range, which no real network routes), never over loopback. Node 0's agent hosts the rendezvous store on
198.18.0.1; gloo's devices bind the veth (GLOO_SOCKET_IFNAME). This is the project's proof that shardwise runs across
machines, not only across processes (issue 14, item 8):

* parity, launched by torchrun: ZeRO-3 over 2 nodes x 2 processes, and dp2 x tp2 through `sw.parallelize`, each match
  one process trained in this test on the same global batch (losses of every step and the final parameters);
* a cut link, launched by `shardwise run` (the two launchers between them, each in one run): `ip link set <veth>
  down` once every rank has trained a few steps; every rank must raise a CommError naming the operation and the
  peers it did not hear from, within the timeout, and nothing may hang. (The same assertions hold under torchrun:
  `TwoHosts.start(..., launcher="torchrun")`.)

The namespaces come from the package's one harness, `shardwise.launch.netns.VethPair` (also used by
bench/compression_netem.py). Needs root and iproute2 (`ip netns`); elsewhere the tests skip with the reason (pytest
-ra prints it). Names carry this process's pid and a random suffix, so parallel runs never collide; the namespaces
(and with them the veth pair) and every process started in them are removed afterwards, whatever happens.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from compose_cases import optimizer
from parity import CONFIG, RTOL, batch

from shardwise.comm import heartbeat
from shardwise.launch.netns import ADDRS, VethPair, why_not
from shardwise.models import GPT

HERE = Path(__file__).resolve().parent
WORKER = HERE / "two_hosts_worker.py"
MASTER_PORT = 29500  # a fresh namespace has no listener at all, so a fixed port cannot collide
PARITY_TIMEOUT = 60.0  # 4 gloo processes share this machine's cores: generous for training, never reached
CUT_TIMEOUT = 5.0  # sw.init(timeout=...): the collectives' deadline and the failure detector's silence
DETECTOR_CALL_S = 5.0  # the most one store call of the failure detector may take (comm/heartbeat.py)
STEPS, MAX_NORM = 3, 0.3  # as in two_hosts_worker.py


class TwoHosts(VethPair):
    """The shared harness (shardwise.launch.netns), plus starting one 2-process node in each namespace."""

    def start(self, mode: str, out: Path, timeout: float, launcher: str = "torchrun") -> None:
        """Start one node (2 processes) in each namespace running two_hosts_worker.py, with torchrun or with
        `shardwise run` (whose supervisor on node 0 hosts the store, as torchrun's agent does)."""
        if launcher == "torchrun":
            torchrun = Path(sys.executable).with_name("torchrun")
            start = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
            start += ["--max-restarts", "0", "--nproc-per-node", "2"]
        elif launcher == "shardwise":
            start = [sys.executable, "-m", "shardwise", "run", "--backend", "gloo", "--timeout", str(timeout),
                     "--nproc", "2"]
        else:
            raise ValueError(f"launcher={launcher!r}; allowed 'torchrun' or 'shardwise'")
        token = secrets.token_hex(16)
        for node, veth in enumerate(self.veth):
            env = {k: v for k, v in os.environ.items()
                   if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "GLOO_SOCKET_IFNAME")}
            env.update(GLOO_SOCKET_IFNAME=veth, SHARDWISE_JOB_TOKEN=token, OMP_NUM_THREADS="1",
                       PYTHONUNBUFFERED="1")
            cmd = [*start, "--nnodes", "2", "--node-rank", str(node), "--master-addr", ADDRS[0], "--master-port",
                   str(MASTER_PORT), str(WORKER), mode, str(out), str(timeout)]
            self.exec(node, cmd, env=env, log=out / f"node{node}.log", cwd=HERE.parent)

    def wait(self, deadline: float) -> list[int | None]:
        """Exit codes of the nodes once both exited or `deadline` (time.monotonic()) passed (None: still running)."""
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.2)
        return [p.poll() for p in self.procs]


@pytest.fixture
def hosts():
    reason = why_not()
    if reason is not None:
        pytest.skip(f"two hosts on one machine: {reason}")
    two = TwoHosts()
    try:
        two.create()
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        two.close()
        detail = getattr(exc, "stderr", "") or exc
        pytest.skip(f"two hosts on one machine: cannot create network namespaces here: {str(detail).strip()}")
    try:
        yield two
    finally:
        two.close()


def _logs(out: Path, stacks: bool = False) -> str:
    """Every node log's tail and every rank's recorded failure, for a failing assertion's message; with `stacks`,
    the ranks still running first print their threads' stacks there (SIGUSR1: the worker's faulthandler)."""
    if stacks:
        for path in out.glob("pid*"):
            try:
                os.kill(int(path.read_text()), signal.SIGUSR1)
            except (ProcessLookupError, ValueError):
                pass
        time.sleep(1.0)
    parts = []
    for path in sorted(out.glob("node*.log")) + sorted(out.glob("failed*.txt")):
        text = path.read_text(errors="replace")
        parts.append(f"--- {path.name} ---\n{text[-3000:]}")
    return "\n".join(parts)


def _reference() -> dict:
    """One process on the whole global batch: the loss of every step and the final parameters."""
    model = GPT(CONFIG, seed=0)
    opt = optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_two_hosts_torchrun_zero3_and_dp2_tp2_match_one_process(hosts, tmp_path):
    hosts.start("parity", tmp_path, PARITY_TIMEOUT, launcher="torchrun")
    codes = hosts.wait(time.monotonic() + 180)
    assert codes == [0, 0], f"torchrun nodes exited with {codes} (None: still running after 180s)\n{_logs(tmp_path, stacks=True)}"
    # The job really ran across the link: each host sent at least the model's fp32 parameters to the other (ZeRO-3
    # all-gathers every parameter in every forward and backward, and the dp groups of dp2 x tp2 span both hosts).
    want = _reference()
    model_bytes = sum(v.numel() * v.element_size() for v in want["state"].values())
    for node in (0, 1):
        assert hosts.sent_bytes(node) > model_bytes, f"node {node} sent {hosts.sent_bytes(node)} bytes over the veth"
    for rank in range(4):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for case in ("zero3", "dp2xtp2"):
            torch.testing.assert_close(torch.tensor(got[case]["losses"]), torch.tensor(want["losses"]),
                                       rtol=RTOL, atol=1e-6, msg=lambda m: f"rank {rank} {case} losses: {m}")
            state = got[case]["state"]
            assert state.keys() == want["state"].keys(), (rank, case)
            for name, value in want["state"].items():
                torch.testing.assert_close(state[name], value, rtol=RTOL, atol=1e-5,
                                           msg=lambda m: f"rank {rank} {case} {name}: {m}")


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_two_hosts_shardwise_run_cut_link_raises_comm_error_on_every_rank(hosts, tmp_path):
    hosts.start("cut", tmp_path, CUT_TIMEOUT, launcher="shardwise")
    deadline = time.monotonic() + 150
    progress = [tmp_path / f"progress{r}" for r in range(4)]
    while not all(p.exists() and int(p.read_text() or 0) >= 2 for p in progress):
        codes = [p.poll() for p in hosts.procs]
        assert time.monotonic() < deadline and codes == [None, None], (
            f"the ranks did not all train 2 steps (node exit codes {codes})\n{_logs(tmp_path, stacks=True)}")
        time.sleep(0.1)
    hosts.cut()
    cut_at = time.time()
    errors = [tmp_path / f"error{r}.json" for r in range(4)]
    # A rank's wait began at the cut at the latest, so it times out CUT_TIMEOUT later; naming the culprits then costs
    # at most one store call of the failure detector (a rank cut off from the store's host waits that long for an
    # answer that never comes). 3 s of slack: 4 processes share this machine's cores.
    limit = CUT_TIMEOUT + DETECTOR_CALL_S + 3.0
    while not all(e.exists() for e in errors) and time.time() < cut_at + limit + 10:
        time.sleep(0.1)
    missing = [r for r, e in enumerate(errors) if not e.exists()]
    assert not missing, f"rank(s) {missing} raised nothing within {limit + 10:g}s of the cut\n{_logs(tmp_path, True)}"
    nodes = ({0, 1}, {2, 3})  # torchrun numbers node k's processes 2k, 2k+1
    for rank, path in enumerate(errors):
        err = json.loads(path.read_text())
        report = f"rank {rank}: {err}"
        assert err.get("op") and err["rank"] == rank, report
        assert err["message"].startswith(err["op"] + "("), report  # the message names the operation first
        assert f"waiting for rank(s) {err['peers']} of group [0, 1, 2, 3]" in err["message"], report
        assert 0.9 * CUT_TIMEOUT <= err["waited"] <= CUT_TIMEOUT + 1.0, report
        assert err["t"] - cut_at <= limit, report
        other = nodes[1 - rank // 2]
        if rank // 2 == 0:
            # Node 0 hosts the store: its ranks read the heartbeats, see the other host's ranks fall silent and
            # blame exactly them, not their neighbour on the same host.
            assert set(err["peers"]) == other, report
            assert all(f"rank {r} sent no heartbeat" in err["message"] for r in other), report
        else:
            # Node 1 is cut off from the store too: it hears from nobody, and says so.
            assert set(err["peers"]) == set(range(4)) - {rank}, report
            assert "the job's store is unreachable from this rank" in err["message"], report


class _SilentStore:
    """A store client that never answers until released, as a TCPStore client does across a cut link (its timeout
    bounds the wait for a key, not a request whose answer never comes); then it answers "no such key"."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.calls = 0

    def clone(self) -> _SilentStore:
        return self

    def set_timeout(self, timeout) -> None:
        pass

    def _answer(self, result):
        self.calls += 1
        self.released.wait()
        return result

    def check(self, keys) -> bool:
        return self._answer(False)

    def set(self, key, value) -> None:
        return self._answer(None)


def test_failure_detector_answers_within_its_store_limit_when_the_store_host_is_cut_off(monkeypatch):
    """What the cut-link test relies on, without namespaces: reading peers' heartbeats from a store that never
    answers costs one store call's limit (not one per key, not forever), every peer counts as not heard from, a
    heartbeat stops in bounded time, and once the store answers again the detector reads it afresh."""
    limit = 0.3
    monkeypatch.setattr(heartbeat, "_STORE_TIMEOUT_S", limit)
    store = _SilentStore()
    watch = heartbeat.RankWatch(store, 0, interval=0.05, silence=2.0)
    try:
        began = time.monotonic()
        peers, clause = watch.culprits([1, 2, 3], [0, 1, 2, 3], time.time(), early=False, deadline=began)
        took = time.monotonic() - began
        assert peers == [1, 2, 3], clause
        assert clause.startswith("the job's store is unreachable from this rank"), clause
        assert all(f"rank {r} not heard from" in clause for r in (1, 2, 3)), clause
        assert took < limit + 0.5, f"explaining took {took:.2f}s with a {limit}s store limit"
        began = time.monotonic()  # the first call is still blocked: the next one does not queue behind it
        assert watch.culprits([1], [0, 1], time.time(), early=False, deadline=began)[0] == [1]
        assert time.monotonic() - began < 0.2
        calls = store.calls
        watch.start()
        time.sleep(0.3)
        assert store.calls <= calls + 2, "a heartbeat kept piling up calls on a store that does not answer"
        began = time.monotonic()
        watch.stop("failed", "CommError: cut off")
        assert time.monotonic() - began < 0.05 + 2 * limit + 0.5, "stopping the heartbeat waited on the store"
    finally:
        store.released.set()
    time.sleep(0.1)  # the blocked calls return; the next call connects afresh and gets real answers
    _, clause = watch.culprits([1], [0, 1], time.time(), early=False, deadline=time.monotonic())
    assert clause == "rank 1 never published a heartbeat", clause


class _BeatingStore:
    """A store holding heartbeat records made at read time: rank 1 beats on; rank 2 stopped beating `gone` seconds
    before the wait began, as a rank across a link cut just then; both were last seen in the same all_reduce."""

    def __init__(self, stopped_at: float) -> None:
        self.stopped_at = stopped_at

    def clone(self) -> _BeatingStore:
        return self

    def set_timeout(self, timeout) -> None:
        pass

    def _record(self, rank: int) -> bytes:
        t = time.time() if rank == 1 else self.stopped_at
        doing = ["all_reduce(op=SUM, numel=1)", [0, 1, 2], self.stopped_at - 0.01]
        return json.dumps({"t": t, "pid": 1, "state": "running", "error": "", "doing": doing,
                           "idle_since": 0.0, "last": None, "failed": None}).encode()

    def check(self, keys) -> bool:
        return all(k.startswith("shardwise/beat/") for k in keys)

    def get(self, key: str) -> bytes:
        return self._record(int(key.rsplit("/", 1)[1]))

    def set(self, key, value) -> None:
        pass


def test_failure_detector_names_a_peer_whose_beats_stopped_just_before_the_wait():
    """A wait that times out `silence` seconds after it began finds the beat of a peer cut off just before it a little
    younger than `silence`; the detector waits for that peer to cross the line (not for a peer that beats on) and
    names it, instead of naming every peer as if nobody stood out."""
    silence = 2.0
    began = time.time()
    store = _BeatingStore(stopped_at=began - 0.1)
    watch = heartbeat.RankWatch(store, 0, interval=0.1, silence=silence)
    time.sleep(silence - 0.3)  # the wait "times out" with rank 2 quiet for silence - 0.2 s
    start = time.monotonic()
    peers, clause = watch.culprits([1, 2], [0, 1, 2], began, early=False, deadline=start)
    assert peers == [2], clause
    assert clause.startswith("rank 2 sent no heartbeat for 2."), clause
    assert time.monotonic() - start < 1.0
