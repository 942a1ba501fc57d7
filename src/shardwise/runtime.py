"""Starting ranks: `init()` inside a launched job, `launch()` to run a function on N local ranks, rank-tagged logs.

`init()` is what a training script calls first: it reads the launcher's environment (see `environment.py`),
initialises torch.distributed (NCCL when CUDA is present, gloo otherwise) and returns the world Communicator; with
no launcher it returns a world of one, so the same script runs unchanged on a laptop. Under mpirun / mpiexec / srun,
`backend="mpi"` returns a Communicator over MPI itself (comm/mpi_backend.py); gloo and NCCL under mpirun rendezvous
through MPI: rank 0 hosts the TCP store on a port the OS picks and broadcasts its address with MPI.

`launch(fn, world_size, *args)` runs `fn(comm, *args)` on every rank and returns the results in rank order. With
`backend="thread"` the ranks are threads of this process (fast; the test harness); with `backend="gloo"` they are
spawned processes that rendezvous through a TCP store this process hosts on 127.0.0.1 (port chosen by the OS, so
parallel launches never race for a port); with `backend="mpi"` they run under `mpirun -np N` (see _mpi_launch.py).
If one rank raises, the others are stopped (thread ranks get a CommError at their next wait; processes are
terminated; an MPI job is aborted) and LaunchError names the failing rank and carries its traceback.
"""

from __future__ import annotations

import importlib.util
import logging
import multiprocessing
import os
import pickle
import socket
import queue as queue_module
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from .comm.base import CommError, Communicator
from .comm.thread_backend import ThreadWorld
from .environment import LaunchEnvironment, detect_environment

__all__ = ["init", "launch", "LaunchError", "get_logger", "set_log_rank"]

INIT_BACKENDS = ("gloo", "nccl", "mpi")
LAUNCH_BACKENDS = ("thread", "gloo", "mpi")


# ---- logging ------------------------------------------------------------------------------------------------------
_rank_of_thread = threading.local()
_process_rank: int | None = None


class _RankFilter(logging.Filter):
    """Tags each record with the rank of the thread (thread ranks) or the process that logged it."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank = getattr(_rank_of_thread, "rank", _process_rank)
        record.rank = "-" if rank is None else rank
        return True


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time of the record (so redirection and capture keep working)."""

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # noqa: ANN001
        pass


def set_log_rank(rank: int | None, *, thread_only: bool = False) -> None:
    """Set the rank shown in log lines of this thread (thread ranks) or of the whole process."""
    global _process_rank
    if thread_only:
        _rank_of_thread.rank = rank
    else:
        _process_rank = rank


def get_logger(name: str = "shardwise") -> logging.Logger:
    """The library's logger; lines read `[rank 3] INFO shardwise.ddp: ...`. Level from SHARDWISE_LOG (default INFO)."""
    root = logging.getLogger("shardwise")
    if not any(isinstance(f, _RankFilter) for h in root.handlers for f in h.filters):
        handler = _StderrHandler()
        handler.addFilter(_RankFilter())
        handler.setFormatter(logging.Formatter("[rank %(rank)s] %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(os.environ.get("SHARDWISE_LOG", "INFO").upper())
        root.propagate = False
    return logging.getLogger(name)


# ---- init -----------------------------------------------------------------------------------------------------------
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
    from .comm import rendezvous

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
    store, init_method = None, None
    if env.source == "torchrun":
        init_method = "env://"  # honours torchrun's agent-hosted store
    elif env.source in ("openmpi", "pmi") and importlib.util.find_spec("mpi4py") is not None:
        # env.master_addr is MASTER_ADDR, or 127.0.0.1 when every rank is on this node; else this host's name.
        store = rendezvous.store_via_mpi(env.rank, env.master_addr or socket.getfqdn(),
                                         int(os.environ.get("MASTER_PORT", 0)), timeout)
    elif env.master_addr is None:
        raise ValueError(
            f"init: the {env.source} environment does not say where rank 0 listens; set MASTER_ADDR and MASTER_PORT"
        )
    else:
        init_method = f"tcp://{env.master_addr}:{env.master_port}"
    comm = rendezvous.join_world(chosen, env.rank, env.world_size, timeout, store=store, init_method=init_method)
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
    from .comm.mpi_backend import MPICommunicator  # initialises MPI; a clear ImportError when mpi4py is missing

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


# ---- launch ---------------------------------------------------------------------------------------------------------
class LaunchError(RuntimeError):
    """A rank of `launch` failed. `rank` is the first rank that failed; `remote_traceback` its traceback text."""

    def __init__(self, rank: int, summary: str, remote_traceback: str) -> None:
        super().__init__(f"rank {rank} failed: {summary}\n--- traceback of rank {rank} ---\n{remote_traceback}")
        self.rank = rank
        self.remote_traceback = remote_traceback


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "thread",
    timeout: float = 60.0,
    threads_per_rank: int | None = None,
) -> list[Any]:
    """Run `fn(comm, *args)` on `world_size` ranks and return the results in rank order.

    backend: "thread" (ranks are threads of this process), "gloo" (spawned processes on 127.0.0.1) or "mpi"
    (processes under `mpirun -np world_size`, each with an MPI Communicator). For processes, `fn`, `args` and the
    results must be picklable, and `fn` must be importable by module and name (or defined in the main script).
    timeout: seconds any collective may wait before raising CommError.
    threads_per_rank: torch intra-op threads of each spawned process (default: cores // world_size, at least 1).
    Raises LaunchError naming the first rank that raised, with its traceback text.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"launch: world_size={world_size!r} must be a positive int")
    if backend not in LAUNCH_BACKENDS:
        raise ValueError(f"launch: backend={backend!r} is not supported; allowed {LAUNCH_BACKENDS}")
    if not timeout > 0:
        raise ValueError(f"launch: timeout={timeout!r} must be a positive number of seconds")
    if backend == "thread":
        return _launch_threads(fn, world_size, args, timeout)
    if backend == "mpi":
        from ._mpi_launch import launch_mpi

        return launch_mpi(fn, world_size, args, timeout, threads_per_rank)
    return _launch_processes(fn, world_size, args, timeout, threads_per_rank)


def _launch_threads(fn: Callable[..., Any], n: int, args: tuple, timeout: float) -> list[Any]:
    world = ThreadWorld(n, timeout)
    comms = world.communicators()
    results: list[Any] = [None] * n
    failures: list[tuple[float, int, BaseException, str]] = []

    def run(rank: int) -> None:
        set_log_rank(rank, thread_only=True)
        try:
            results[rank] = fn(comms[rank], *args)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the caller, named by rank
            failures.append((time.monotonic(), rank, exc, traceback.format_exc()))
            world.abort(f"rank {rank} raised {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run, args=(r,), name=f"shardwise-rank{r}", daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        # The root cause is the first failure that is not merely another rank being aborted because of it.
        failures.sort(key=lambda f: (isinstance(f[2], CommError) and "aborted" in str(f[2]), f[0]))
        _, rank, exc, text = failures[0]
        raise LaunchError(rank, f"{type(exc).__name__}: {exc}", text) from exc
    return results


def _process_main(
    rank: int, n: int, port: int, timeout: float, threads: int, fn: Callable, args: tuple, out: Any
) -> None:
    """Body of one spawned gloo rank: join the store-hosted rendezvous, run fn, send back the pickled result."""
    from .comm import rendezvous

    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
         "MASTER_PORT": str(port)}
    )
    torch.set_num_threads(threads)
    set_log_rank(rank)
    try:
        store = rendezvous.join_store("127.0.0.1", port, timeout, rank=rank)
        comm = rendezvous.join_world("gloo", rank, n, timeout, store=store)
        result = fn(comm, *args)
        # Plain pickle copies tensors by value; a torch multiprocessing queue would hand over shared memory that
        # dies with this process.
        payload = pickle.dumps(result)
        out.put(("ok", rank, payload))
    except BaseException as exc:  # noqa: BLE001
        out.put(("error", rank, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    finally:
        rendezvous.leave_world()


def _launch_processes(fn: Callable[..., Any], n: int, args: tuple, timeout: float, threads: int | None) -> list[Any]:
    from .comm import rendezvous

    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise ValueError(
            f"launch(backend='gloo') needs a function importable by module and name (defined at module level); "
            f"{fn!r} cannot be pickled: {exc}"
        ) from None
    threads = threads or max(1, (os.cpu_count() or 1) // n)
    # The parent hosts the rendezvous store on a port the OS picks: no free-port race between parallel launches.
    store = rendezvous.host_store("127.0.0.1", 0, timeout)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_process_main, args=(r, n, store.port, timeout, threads, fn, args, out),
                    name=f"shardwise-rank{r}", daemon=True)
        for r in range(n)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        while len(results) < n:
            try:
                message = out.get(timeout=0.2)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    time.sleep(0.5)  # the rank may have queued its error just before dying: prefer that message
                    if out.empty():
                        r = dead[0]
                        raise LaunchError(r, f"process exited with code {procs[r].exitcode}", "(no traceback: killed)")
                continue
            if message[0] == "error":
                _, rank, summary, text = message
                raise LaunchError(rank, summary, text)
            _, rank, payload = message
            results[rank] = pickle.loads(payload)
        for p in procs:
            p.join(timeout)
        return [results[r] for r in range(n)]
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        del store
