"""`init()`: join the job this process was launched into and return the world Communicator.

`init()` is what a training script calls first. It reads the launcher's environment (see `environment.py`), joins
the torch.distributed world (NCCL when CUDA is present, gloo otherwise) through comm/rendezvous.py and returns the
world Communicator; with no launcher it returns a world of one, so the same script runs unchanged on a laptop.
Where the rendezvous store lives depends on the launcher: torchrun's agent hosts it (`env://`); under mpirun /
mpiexec with mpi4py installed, rank 0 hosts it on a port the OS picks and broadcasts its address with MPI; otherwise
(srun, MPI without mpi4py, or RANK / WORLD_SIZE set by hand) rank 0 hosts it at MASTER_ADDR:MASTER_PORT. A store that
rank 0 hosts on a loopback MASTER_ADDR listens on that address only, and gloo then stays on the loopback interface.
When SHARDWISE_JOB_TOKEN is set (the same value on every rank; see docs/guide.md) every key of the job lives under it.
With NCCL, this rank's GPU is chosen by `environment.cuda_device_index` (the local rank's, or the one GPU srun bound
to the task) and becomes the Communicator's `device`, where strategies put the model and every collective's tensors.

Two timeouts. `timeout` is shardwise's: every wait of a collective on CPU, and every stream-ordered collective on GPU
checked at the next communication call, raises CommError naming the operation and the peers after that long.
`nccl_timeout` is the NCCL process group's own (its watchdog's), deliberately longer (30 min by default, at least
`timeout`): the watchdog kills the process without naming anyone, so shardwise's CommError must come first, and a
first step that compiles or loads for minutes must not trip it.
Each rank runs a heartbeat in the store, so its CommErrors name the peer that failed. With `backend="mpi"` the
Communicator is MPI itself (comm/mpi_backend.py), checked against the launcher's idea of the world size.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import socket

import torch

from ..comm.base import CommError, Communicator
from ..comm.thread_backend import ThreadWorld
from .environment import cuda_device_index, detect_environment
from .logs import set_log_rank

__all__ = ["init", "DEFAULT_TIMEOUT", "DEFAULT_NCCL_TIMEOUT"]

INIT_BACKENDS = ("gloo", "nccl", "mpi")
BACKEND_ENV = "SHARDWISE_BACKEND"  # the default backend, set by `shardwise run --backend`
DEFAULT_TIMEOUT = 60.0  # seconds: shardwise's CommError deadline
DEFAULT_NCCL_TIMEOUT = 1800.0  # seconds: the NCCL process group's watchdog (torch's default too); >= 10 minutes

log = logging.getLogger("shardwise.launch")


def init(backend: str | None = None, timeout: float = DEFAULT_TIMEOUT, *,
         nccl_timeout: float = DEFAULT_NCCL_TIMEOUT) -> Communicator:
    """Join the job this process was launched into and return the world Communicator.

    backend: "gloo", "nccl", "mpi", or None (SHARDWISE_BACKEND when set, as `shardwise run --backend` sets it;
    else NCCL when CUDA is available, else gloo). "mpi" needs a job started
    by mpirun / mpiexec / srun and mpi4py; gloo and NCCL under mpirun / mpiexec rendezvous through MPI when mpi4py
    is installed (else at MASTER_ADDR:MASTER_PORT, default 127.0.0.1:29500 on one node), and under srun at the first
    node of the step on a port derived from the job id.
    timeout: seconds every collective, and the rendezvous itself, may wait before raising CommError.
    nccl_timeout: seconds the NCCL process group's watchdog lets a collective run before it aborts the process (NCCL
        only; must be >= timeout, so that shardwise's CommError, which names the culprits, comes first).
    Without launcher variables (see `environment.py`) this returns a world of one. Calling init() again after
    torch.distributed was initialised (by shardwise or by the user) wraps the existing world group.
    """
    # Imported here, not at the top: the torch backend needs a PyTorch built with torch.distributed, which a world
    # of one (and backend="mpi") does not.
    from ..comm import rendezvous

    if backend is None and os.environ.get(BACKEND_ENV):  # `shardwise run --backend ...` chooses for the script
        backend = os.environ[BACKEND_ENV]
        if backend not in INIT_BACKENDS:
            raise ValueError(f"init: {BACKEND_ENV}={backend!r} is not supported; allowed {INIT_BACKENDS}")
    if backend is not None and backend not in INIT_BACKENDS:
        raise ValueError(f"init: backend={backend!r} is not supported; allowed {INIT_BACKENDS} or None")
    if not timeout > 0:
        raise ValueError(f"init: timeout={timeout!r} must be a positive number of seconds")
    if not nccl_timeout >= timeout:
        raise ValueError(f"init: nccl_timeout={nccl_timeout!r} must be a number of seconds >= timeout={timeout!r} "
                         f"(the NCCL watchdog must not kill the job before shardwise's CommError names the culprit)")
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
        # Not set_device(local_rank): under srun --gpus-per-task=1 every task sees one GPU, numbered 0.
        index = cuda_device_index(env.local_rank, torch.cuda.device_count())
        torch.cuda.set_device(index)
        log.debug("rank %d (local rank %d) uses cuda:%d of %d visible", env.rank, env.local_rank, index,
                  torch.cuda.device_count())
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
                                 local=rendezvous.is_loopback(addr),
                                 backend_timeout=nccl_timeout if chosen == "nccl" else None)
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
