"""`launch(fn, world_size, *args)`: run `fn(comm, *args)` on N local ranks and return the results in rank order.

With `backend="thread"` the ranks are threads of this process sharing a ThreadWorld (fast; the test harness). With
`backend="gloo"` they are spawned processes that rendezvous through a TCP store this process hosts on 127.0.0.1
(port chosen by the OS, so parallel launches never race for a port); each sends back its pickled result or its
error and traceback on a queue. With `backend="mpi"` they run under `mpirun -np N` (see mpi.py). If one rank
raises, the others are stopped (thread ranks get a CommError at their next wait; processes are terminated; an MPI
job is aborted) and LaunchError names the failing rank and carries its traceback.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue as queue_module
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from ..comm.base import CommError
from ..comm.thread_backend import ThreadWorld
from .errors import LaunchError
from .logs import rank_logging_installed, set_log_rank, start_rank_logging
from .mpi import launch_mpi

__all__ = ["launch"]

LAUNCH_BACKENDS = ("thread", "gloo", "mpi")


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
    rank: int, n: int, port: int, timeout: float, threads: int, logs: bool, fn: Callable, args: tuple, out: Any
) -> None:
    """Body of one spawned gloo rank: join the store-hosted rendezvous, run fn, send back the pickled result."""
    from ..comm import rendezvous

    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
         "MASTER_PORT": str(port)}
    )
    torch.set_num_threads(threads)
    start_rank_logging(rank, logs)
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
    from ..comm import rendezvous

    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise ValueError(
            f"launch(backend='gloo') needs a function importable by module and name (defined at module level); "
            f"{fn!r} cannot be pickled: {exc}"
        ) from None
    threads = threads or max(1, (os.cpu_count() or 1) // n)
    logs = rank_logging_installed()
    # The parent hosts the rendezvous store on a port the OS picks: no free-port race between parallel launches.
    store = rendezvous.host_store("127.0.0.1", 0, timeout)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_process_main, args=(r, n, store.port, timeout, threads, logs, fn, args, out),
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
