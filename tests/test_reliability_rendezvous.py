"""Rendezvous on loopback only: the store of a local job listens on 127.0.0.1 only, gloo stays on loopback, and a
per-job token keeps every key of a job away from processes that do not know it (issue 12, item 6)."""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from ports import free_port

import shardwise as sw
from shardwise.comm import rendezvous

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp")


def _listeners(pids) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every listening TCP socket the processes `pids` own, read from /proc."""
    owner = {}
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    owner[target[8:-1]] = pid
        except OSError:
            continue
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with open(table) as f:
            rows = f.read().splitlines()[1:]
        for row in rows:
            fields = row.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in owner:  # 0A: LISTEN
                continue
            hex_addr, hex_port = local.split(":")
            raw = bytes.fromhex(hex_addr)
            # /proc prints the address as 32-bit words in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.append((socket.inet_ntop(family, raw), int(hex_port, 16), owner[inode]))
    return found


def _job_listeners(comm, launcher_pid):
    """Rank 0 lists the listening sockets of the launcher and of every rank, once every rank's gloo device is up."""
    pids = torch.zeros(comm.size, dtype=torch.int64)
    comm.all_gather(pids, torch.tensor([os.getpid()]))
    found = _listeners([launcher_pid, *pids.tolist()]) if comm.rank == 0 else None
    comm.barrier()  # nobody leaves (closing its gloo listener) before rank 0 looked
    return found, int(os.environ["MASTER_PORT"]), os.environ.get("GLOO_SOCKET_IFNAME")


@linux_only
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_gloo_launch_listens_on_loopback_only():
    results = sw.launch(_job_listeners, 2, os.getpid(), backend="gloo", timeout=30)  # ranks' parent: the fork server
    found, store_port, _ = results[0]
    assert any(port == store_port for _, port, _ in found), f"the store's port {store_port} is not listening: {found}"
    assert len(found) >= 3, found  # the launcher's store and each rank's gloo device
    assert {addr for addr, _, _ in found} == {"127.0.0.1"}, f"a listener outside loopback: {found}"
    assert {ifname for _, _, ifname in results} == {"lo"}


_INIT_RANK = textwrap.dedent("""
    import json, os, sys, torch
    sys.path.insert(0, os.environ["TESTS_DIR"])
    import shardwise as sw
    from test_reliability_rendezvous import _listeners
    comm = sw.init(backend="gloo", timeout=30)
    t = torch.ones(1)
    comm.all_reduce(t)
    found = _listeners([os.getpid()])
    comm.barrier()
    print(json.dumps({"rank": comm.rank, "sum": t.item(), "listeners": found}))
""")


@linux_only
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_init_on_a_loopback_master_addr_hosts_the_store_on_loopback_only():
    port = free_port()
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           rendezvous.JOB_TOKEN_ENV: rendezvous.new_job_token(), "TESTS_DIR": os.path.dirname(__file__)}
    for name in ("GLOO_SOCKET_IFNAME", "TORCHELASTIC_USE_AGENT_STORE"):
        env.pop(name, None)
    ranks = [subprocess.Popen([sys.executable, "-c", _INIT_RANK], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outputs = [p.communicate(timeout=90) for p in ranks]
    assert all(p.returncode == 0 for p in ranks), outputs
    rank0 = json.loads(outputs[0][0].strip().splitlines()[-1])
    assert rank0["sum"] == 2.0
    assert port in [p for _, p, _ in rank0["listeners"]], rank0  # rank 0 hosts the store at MASTER_PORT
    assert {addr for addr, _, _ in rank0["listeners"]} == {"127.0.0.1"}, rank0


@linux_only
def test_host_store_binds_the_loopback_address_it_is_given():
    for addr in ("127.0.0.1", "localhost"):
        store = rendezvous.host_store(addr, 0, timeout=5)
        mine = [(a, p) for a, p, _ in _listeners([os.getpid()]) if p == store.port]
        assert mine == [("127.0.0.1", store.port)], mine
        del store


def test_is_loopback():
    assert all(rendezvous.is_loopback(a) for a in ("127.0.0.1", "127.0.1.1", "::1", "localhost", "LOCALHOST"))
    assert not any(rendezvous.is_loopback(a) for a in ("10.0.0.1", "0.0.0.0", "node7", "", None))


def test_a_client_without_the_job_token_cannot_read_or_disturb_the_jobs_keys():
    host = rendezvous.host_store("127.0.0.1", 0, timeout=5)
    token = rendezvous.new_job_token()
    assert len(token) == 32 and token != rendezvous.new_job_token()
    job = rendezvous.job_store(host, token)
    job.set("rank0/address", "10.0.0.1:1234")  # what a rendezvous leaves for the ranks

    stranger = rendezvous.join_store("127.0.0.1", host.port, timeout=5, rank=1)
    views = (stranger, rendezvous.job_store(stranger, "wrong-token"))
    assert not any(view.check(["rank0/address"]) for view in views)  # cannot read it ...
    for view in views:
        view.set("rank0/address", "evil:6666")  # ... and what it writes lands in another key space
    member = rendezvous.job_store(rendezvous.join_store("127.0.0.1", host.port, timeout=5, rank=1), token)
    assert member.get("rank0/address") == b"10.0.0.1:1234"


def test_a_rank_without_the_token_cannot_join_the_job():
    host = rendezvous.host_store("127.0.0.1", 0, timeout=5)
    token = rendezvous.new_job_token()
    # torch's rendezvous waits for keys the job's ranks publish; a process without the token waits in another key
    # space, so it never completes a join (here: its wait for rank 0's key times out).
    rendezvous.job_store(host, token).set("rank_0_ready", "1")
    outsider = rendezvous.job_store(rendezvous.join_store("127.0.0.1", host.port, timeout=5, rank=1), "guess")
    outsider.set_timeout(datetime.timedelta(seconds=0.5))
    with pytest.raises(Exception, match="(?i)timeout|wait"):
        outsider.wait(["rank_0_ready"])
    insider = rendezvous.job_store(rendezvous.join_store("127.0.0.1", host.port, timeout=5, rank=1), token)
    insider.wait(["rank_0_ready"])
