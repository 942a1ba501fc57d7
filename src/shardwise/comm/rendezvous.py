"""Joining and leaving a torch.distributed world: the rendezvous store and the default process group.

A torch.distributed job starts with a rendezvous: one process hosts a key-value store (torch's TCPStore), every
rank connects to it, and `init_process_group` swaps the backend's connection details through it. Who hosts the
store is the launcher's business (shardwise/launch/): torchrun's agent hosts it and names it in MASTER_ADDR /
MASTER_PORT (`init_method="env://"`); `launch(..., backend="gloo")` hosts it in the parent process on a port the
OS picks; under mpirun rank 0 hosts it and broadcasts the address over MPI (`store_via_mpi`). The calls themselves
live here so that the launch code never touches torch.distributed (DESIGN.md, rule 1).

Every function raises CommError naming this rank and the address when the rendezvous fails within `timeout`
seconds, instead of torch's assorted connection errors.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist

from .base import CommError
from .torch_backend import TorchCommunicator

__all__ = [
    "distributed_available",
    "host_store",
    "join_store",
    "join_world",
    "leave_world",
    "store_via_mpi",
    "world_communicator",
    "world_initialized",
]


def distributed_available() -> bool:
    """Whether this PyTorch build has torch.distributed at all (some mobile and macOS builds do not)."""
    return dist.is_available()


def world_initialized() -> bool:
    """Whether the default process group exists (made by shardwise or by the user's own init_process_group)."""
    return dist.is_available() and dist.is_initialized()


def world_communicator(timeout: float) -> TorchCommunicator:
    """The Communicator over the existing default process group."""
    return TorchCommunicator(None, timeout=timeout)


def host_store(addr: str, port: int, timeout: float) -> dist.TCPStore:
    """Host the rendezvous store on addr:port (port 0: the OS picks a free one; read it back from `.port`).

    The store does not wait for its clients here: they connect later, inside `init_process_group`.
    """
    return dist.TCPStore(addr, port, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout))


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
    backend: str, rank: int, size: int, timeout: float, *, store: Any = None, init_method: str | None = None
) -> TorchCommunicator:
    """Create the default process group (through `store`, else `init_method`) and return its Communicator.

    `timeout` bounds the rendezvous and becomes the deadline of every later collective of the world.
    """
    where = f"tcp://{store.host}:{store.port}" if store is not None else init_method
    delta = datetime.timedelta(seconds=timeout)
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
    return world_communicator(timeout)


def leave_world() -> None:
    """Destroy the default process group, if any (a spawned rank does so before it exits, so gloo closes cleanly)."""
    if world_initialized():
        dist.destroy_process_group()


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
