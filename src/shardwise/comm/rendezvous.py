"""Joining and leaving a torch.distributed world: the rendezvous store, the job's key space, the default group.

A torch.distributed job starts with a rendezvous: one process hosts a key-value store (torch's TCPStore), every
rank connects to it, and `init_process_group` swaps the backend's connection details through it. Who hosts the
store is the launcher's business (shardwise/launch/): torchrun's agent hosts it and names it in MASTER_ADDR /
MASTER_PORT (`env_store`); `launch(..., backend="gloo")` hosts it in the parent process on a port the OS picks; under
mpirun rank 0 hosts it and broadcasts the address over MPI (`store_via_mpi`); otherwise rank 0 hosts it at
MASTER_ADDR:MASTER_PORT (`rank_zero_store`). The calls themselves live here so that the launch code never touches
torch.distributed (DESIGN.md, rule 1).

Exposure. A store hosted on a loopback address (127.0.0.1, ::1, localhost) listens on that address only: torch's
TCPStore binds every interface whatever host it is given, so `host_store` binds the socket itself and hands it over
(`master_listen_fd`). gloo's device of a local job is pinned to the loopback interface (GLOO_SOCKET_IFNAME, unless the
user set it). A job whose ranks span hosts cannot stay on loopback: there `job_store` puts every key of the job
(torch's own rendezvous keys and shardwise's heartbeats) under a per-job token (SHARDWISE_JOB_TOKEN, made by the
launcher with `new_job_token`), so a process that does not know the token neither joins the job nor disturbs it by
accident. The store and gloo's links are unauthenticated transport, as with torchrun: anyone who reaches the store's
port can list its keys (and so read the token), so run multi-node jobs on a private network (docs/guide.md).

Every function raises CommError naming this rank and the address when the rendezvous fails within `timeout`
seconds, instead of torch's assorted connection errors.
"""

from __future__ import annotations

import atexit
import datetime
import ipaddress
import logging
import os
import secrets
import socket
import sys
from typing import Any

import torch.distributed as dist

from .background import stop_workers
from .base import CommError
from .group_release import release_process_groups
from .heartbeat import RankWatch
from .torch_backend import TorchCommunicator

__all__ = [
    "JOB_TOKEN_ENV",
    "distributed_available",
    "env_store",
    "host_store",
    "is_loopback",
    "job_store",
    "join_store",
    "join_world",
    "leave_world",
    "new_job_token",
    "rank_zero_store",
    "store_via_mpi",
    "world_communicator",
    "world_initialized",
]

JOB_TOKEN_ENV = "SHARDWISE_JOB_TOKEN"
_WORKER_EXIT_S = 10.0  # leave_world: how long the background collectives may take to finish their last jobs
log = logging.getLogger("shardwise.comm")


def distributed_available() -> bool:
    """Whether this PyTorch build has torch.distributed at all (some mobile and macOS builds do not)."""
    return dist.is_available()


def world_initialized() -> bool:
    """Whether the default process group exists (made by shardwise or by the user's own init_process_group)."""
    return dist.is_available() and dist.is_initialized()


def world_communicator(timeout: float, watch: RankWatch | None = None) -> TorchCommunicator:
    """The Communicator over the existing default process group (`watch`: this rank's heartbeat, if any)."""
    return TorchCommunicator(None, timeout=timeout, _watch=watch)


def is_loopback(addr: str | None) -> bool:
    """Whether `addr` names this host's loopback interface (127.0.0.0/8, ::1 or "localhost")."""
    if addr is None:
        return False
    if addr.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def host_store(addr: str, port: int, timeout: float) -> dist.TCPStore:
    """Host the rendezvous store on addr:port (port 0: the OS picks a free one; read it back from `.port`).

    A loopback `addr` is the address the store listens on, and the only one; any other address keeps torch's
    behaviour (every interface), which a multi-node job needs when `addr` is a name other hosts resolve. The store
    does not wait for its clients here: they connect later, inside `init_process_group`.
    """
    delta = datetime.timedelta(seconds=timeout)
    if not is_loopback(addr):
        return dist.TCPStore(addr, port, is_master=True, wait_for_workers=False, timeout=delta)
    host = "127.0.0.1" if addr.lower() == "localhost" else addr
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own server does
        sock.bind((host, port))
        sock.listen(socket.SOMAXCONN)
        bound = sock.getsockname()[1]
    except OSError as exc:
        sock.close()
        raise CommError(f"init: cannot host the rendezvous store on {host}:{port}: {exc}", op="init") from exc
    fd = sock.detach()  # the store owns the socket from here, and closes it when it is destroyed
    try:
        return dist.TCPStore(host, bound, is_master=True, wait_for_workers=False, timeout=delta, master_listen_fd=fd)
    except Exception:
        os.close(fd)
        raise


def new_job_token() -> str:
    """A fresh per-job token (128 random bits, hex): the launcher's, passed to the ranks in SHARDWISE_JOB_TOKEN."""
    return secrets.token_hex(16)


def job_store(store: Any, token: str | None) -> Any:
    """The job's key space in `store`: every key under `shardwise/<token>/`, or `store` itself without a token."""
    # PrefixStore puts the "/" between prefix and key itself ("x/" would make "x//key").
    return dist.PrefixStore(f"shardwise/{token}", store) if token else store


def rank_zero_store(addr: str, port: int, rank: int, timeout: float) -> Any:
    """The store of a job whose rank 0 hosts it at addr:port (`host_store`) and whose other ranks connect there."""
    return host_store(addr, port, timeout) if rank == 0 else join_store(addr, port, timeout, rank=rank)


def env_store(rank: int, size: int, timeout: float) -> Any:
    """The store torchrun's environment names (MASTER_ADDR / MASTER_PORT), joined exactly as `env://` would: through
    torchrun's agent when it hosts the store, else rank 0 hosts it."""
    try:
        store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=size,
                                           timeout=datetime.timedelta(seconds=timeout)))
    except Exception as exc:
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        raise CommError(f"init: rank {rank} could not reach the rendezvous store at {where} within {timeout:g}s: "
                        f"{exc}", op="init", rank=rank, peers=[0]) from exc
    return store


def join_store(addr: str, port: int, timeout: float, *, rank: int) -> dist.TCPStore:
    """Connect to the store another process hosts at addr:port, retrying until `timeout` seconds have passed."""
    try:
        return dist.TCPStore(addr, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))
    except Exception as exc:
        raise CommError(
            f"init: rank {rank} could not reach rank 0's store at {addr}:{port} within {timeout:g}s: {exc}",
            op="init",
            rank=rank,
            peers=[0],
        ) from exc


def join_world(
    backend: str, rank: int, size: int, timeout: float, *, store: Any = None, init_method: str | None = None,
    local: bool = False, launcher_pid: int | None = None, backend_timeout: float | None = None,
) -> TorchCommunicator:
    """Create the default process group (through `store`, else `init_method`) and return its Communicator.

    `timeout` bounds the rendezvous and becomes the deadline of every later collective of the world.
    local: every rank runs on this host, so gloo's device is pinned to the loopback interface.
    With a `store`, this rank also starts its heartbeat (comm/heartbeat.py) there: its CommErrors then name the
    culprit peers. launcher_pid: the launching process; the rank exits when it dies (no orphans).
    backend_timeout: the process group's own timeout (NCCL's watchdog), when it must be longer than `timeout`.
    """
    where = _address(store) if store is not None else init_method
    delta = datetime.timedelta(seconds=timeout if backend_timeout is None else max(timeout, backend_timeout))
    if local and backend == "gloo":
        _pin_gloo_to_loopback()
    try:
        if store is not None:
            dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=delta)
        else:
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=delta)
    except Exception as exc:
        raise CommError(
            f"init: rank {rank} could not join the {size}-rank {backend} job at {where} within {timeout:g}s: {exc}",
            op="init",
            rank=rank,
        ) from exc
    watch = None
    if store is not None:
        silence = max(2.0, timeout)  # the heartbeat's own timeout: a rank silent this long is dead or frozen
        try:
            watch = RankWatch(store, rank, interval=min(0.5, silence / 4), silence=silence, launcher_pid=launcher_pid)
        except Exception:  # noqa: BLE001 - a store that cannot be cloned: no heartbeat, errors name every peer
            watch = None
        else:
            watch.start()
    comm = TorchCommunicator(None, timeout=timeout, _watch=watch, backend_timeout=delta.total_seconds())
    if backend == "gloo":
        # A gloo world still alive when the interpreter exits can abort the process in torch's teardown
        # ("terminate called without an active exception", exit code 134 after a successful job): leave it first.
        atexit.register(_leave_at_exit, comm)
    return comm


def leave_world(comm: TorchCommunicator | None = None, error: str | None = None) -> None:
    """Destroy the default process group, if any (a spawned rank does so before it exits, so gloo closes cleanly),
    after the background collectives' threads ended (their last jobs done, 10 s at most; none awaited after an
    error) and the heartbeat's last store call returned.

    comm: the world Communicator, whose heartbeat then publishes its final state first: "done", or "failed" with
    `error` (one line), which peers still waiting read as the cause.
    """
    # The background collectives' threads finish what they were given and end before the groups they use go, so
    # that no daemon thread is inside a torch call when the interpreter finalizes (background.py).
    stuck = stop_workers(0.0 if error else _WORKER_EXIT_S)
    if stuck:
        log.warning("leaving the world with background collectives still running on %s", ", ".join(stuck))
    watch = getattr(comm, "_watch", None)
    if watch is not None:
        watch.stop("failed" if error else "done", error or "")
    if world_initialized():
        dist.destroy_process_group()
    release_process_groups()  # the sub-groups the communicators still hold: destroyed now, their threads joined


def _leave_at_exit(comm: TorchCommunicator) -> None:
    uncaught = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    try:
        leave_world(comm, f"{type(uncaught).__name__}: {uncaught}" if uncaught is not None else None)
    except Exception:  # noqa: BLE001 - nothing may fail at exit
        pass


def _address(store: Any) -> str:
    """tcp://host:port of a (prefixed) TCPStore, for error messages."""
    while not hasattr(store, "host") and hasattr(store, "underlying_store"):
        store = store.underlying_store
    return f"tcp://{getattr(store, 'host', '?')}:{getattr(store, 'port', '?')}"


def _pin_gloo_to_loopback() -> None:
    """gloo binds its device to the interface GLOO_SOCKET_IFNAME names (read when the group is created); a local
    job uses loopback unless the user chose an interface."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    names = {name for _, name in socket.if_nameindex()}
    loopback = next((name for name in ("lo", "lo0") if name in names), None)
    if loopback is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = loopback


def store_via_mpi(rank: int, addr: str | None, port: int, timeout: float) -> dist.TCPStore:
    """The rendezvous store of a job started by mpirun: rank 0 hosts it on `addr`:`port` (port 0: the OS picks) and
    broadcasts where through MPI, the others connect there. `addr` and `port` are read on rank 0 only.

    A failure to host is broadcast too, so that no rank waits in vain for an address that will never come.
    """
    from .mpi_backend import bcast_json  # initialises MPI; only reached when mpi4py is installed

    store = None
    if rank == 0:
        info: dict[str, Any] = {"addr": addr, "port": 0, "error": None}
        try:
            store = host_store(addr, port, timeout)
            info["port"] = store.port
        except Exception as exc:
            info["error"] = f"{type(exc).__name__}: {exc}"
    else:
        info = {}
    info = bcast_json(info, timeout=timeout)
    if info["error"]:
        raise CommError(f"init: rank 0 could not host the rendezvous store: {info['error']}", op="init", rank=rank)
    return store if store is not None else join_store(info["addr"], info["port"], timeout, rank=rank)
