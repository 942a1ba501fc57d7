"""`init()`: join the job this process was launched into and return the world Communicator.

`init()` is what a training script calls first. It reads the launcher's environment (see `environment.py`), joins
the torch.distributed world (NCCL when CUDA is present, gloo otherwise) through comm/rendezvous.py and returns the
world Communicator; with no launcher it returns a world of one, so the same script runs unchanged on a laptop.
Where the rendezvous store lives depends on the launcher: torchrun's agent hosts it (`env://`); under mpirun /
mpiexec with mpi4py installed, rank 0 hosts it on a port the OS picks and broadcasts its address with MPI; otherwise
(srun, MPI without mpi4py, or RANK / WORLD_SIZE set by hand) rank 0 hosts it at MASTER_ADDR:MASTER_PORT. A store that
rank 0 hosts on a loopback MASTER_ADDR listens on that address only, and gloo then stays on the loopback interface.
When SHARDWISE_JOB_TOKEN is set (the same value on every rank; see docs/guide.md) every key of the job lives under it.
Each rank runs a heartbeat in the store, so its CommErrors name the peer that failed. With `backend="mpi"` the
Communicator is MPI itself (comm/mpi_backend.py), checked against the launcher's idea of the world size.
"""

from __future__ import annotations

import importlib.util
import os
import socket

import torch

from ..comm.base import CommError, Communicator
from ..comm.thread_backend import ThreadWorld
from .environment import detect_environment
from .logs import set_log_rank

__all__ = ["init"]

INIT_BACKENDS = ("gloo", "nccl", "mpi")


def init(backend: str | None = None, timeout: float = 60.0) -> Communicator:
    """Join the job this process was launched into and return the world Communicator.

    backend: "gloo", "nccl", "mpi", or None (NCCL when CUDA is available, else gloo). "mpi" needs a job started
    by mpirun / mpiexec / srun and mpi4py; gloo and NCCL under mpirun / mpiexec rendezvous through MPI when mpi4py
    is installed (else at MASTER_ADDR:MASTER_PORT, default 127.0.0.1:29500 on one node), and under srun at the first
    node of the step on a port derived from the job id.
    timeout: seconds every collective, and the rendezvous itself, may wait before raising CommError.
    Without launcher variables (see `environment.py`) this returns a world of one. Calling init() again after
    torch.distributed was initialised (by shardwise or by the user) wraps the existing world group.
    """
    # Imported here, not at the top: the torch backend needs a PyTorch built with torch.distributed, which a world
    # of one (and backend="mpi") does not.
    from ..comm import rendezvous

    if backend is not None and backend not in INIT_BACKENDS:
        raise ValueError(f"init: backend={backend!r} is not supported; allowed {INIT_BACKENDS} or None")
    if not timeout > 0:
        raise ValueError(f"init: timeout={timeout!r} must be a positive number of seconds")
    if backend == "mpi":
        return _init_mpi(timeout)
    if rendezvous.world_initialized():
        return rendezvous.world_communicator(timeout)
    env = detect_environment()
    if env.world_size == 1:
        set_log_rank(0)
        return ThreadWorld(1, timeout).communicators()[0]
    if not rendezvous.distributed_available():
        raise RuntimeError("this PyTorch build has no torch.distributed; it cannot join a multi-process job")
    chosen = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if chosen == "nccl":
        torch.cuda.set_device(env.local_rank)
    addr = env.master_addr
    if env.source == "torchrun" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = rendezvous.env_store(env.rank, env.world_size, timeout)  # torchrun's agent hosts it, as env:// has it
    elif env.source in ("openmpi", "pmi") and importlib.util.find_spec("mpi4py") is not None:
        # env.master_addr is MASTER_ADDR, or 127.0.0.1 when every rank is on this node; else this host's name.
        addr = addr or socket.getfqdn()
        store = rendezvous.store_via_mpi(env.rank, addr, int(os.environ.get("MASTER_PORT", 0)), timeout)
    elif addr is None or env.master_port is None:
        raise ValueError(
            f"init: the {env.source} environment does not say where rank 0 listens; set MASTER_ADDR and MASTER_PORT"
        )
    else:
        store = rendezvous.rank_zero_store(addr, env.master_port, env.rank, timeout)
    store = rendezvous.job_store(store, os.environ.get(rendezvous.JOB_TOKEN_ENV))
    comm = rendezvous.join_world(chosen, env.rank, env.world_size, timeout, store=store,
                                 local=rendezvous.is_loopback(addr))
    set_log_rank(env.rank)
    return comm


def _init_mpi(timeout: float) -> Communicator:
    """init(backend="mpi"): the world Communicator over MPI, checked against the launcher's idea of the world."""
    env = detect_environment()
    if env.source == "torchrun":
        raise ValueError(
            "init: backend='mpi' needs a job started by mpirun, mpiexec or srun, but this process was started by "
            "torchrun (RANK and WORLD_SIZE are set); use backend='gloo' or 'nccl', or launch with mpirun"
        )
    if env.world_size == 1:
        set_log_rank(0)
        return ThreadWorld(1, timeout).communicators()[0]
    from ..comm.mpi_backend import MPICommunicator  # initialises MPI; a clear ImportError when mpi4py is missing

    comm = MPICommunicator(timeout=timeout)
    if comm.size != env.world_size:
        raise CommError(
            f"init: the {env.source} launcher started {env.world_size} ranks but MPI sees a world of {comm.size} on "
            f"rank {env.rank}: this MPI library is not wired to the launcher (under srun try `srun --mpi=pmix`, or "
            f"start the job with the mpirun of the MPI that mpi4py loads)",
            op="init",
            rank=env.rank,
        )
    set_log_rank(comm.rank)
    return comm
