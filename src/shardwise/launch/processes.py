"""`launch(fn, world_size, *args)`: run `fn(comm, *args)` on N local ranks and return the results in rank order.

With `backend="thread"` the ranks are threads of this process sharing a ThreadWorld (fast; the test harness). With
`backend="gloo"` they are spawned processes that rendezvous through a TCP store this process hosts on 127.0.0.1 only
(port chosen by the OS, so parallel launches never race for a port; every key under a fresh job token; gloo pinned to
loopback); each sends back its pickled result, or its error and traceback, on its own pipe. The processes are forked
from multiprocessing's fork server, which imported torch and shardwise once (`_rank_context`): a rank starts in a
fraction of a second instead of paying the ~2 s of CPU of a fresh interpreter importing torch (where there is no fork
server, they are spawned). Each rank takes the launcher's environment, standard output and error of the moment of the
launch, as a spawned process would (the fork server's own are those of its start). With `backend="mpi"` they
run under `mpirun -np N` (see mpi.py).

Failures. A FailureDetector (detector.py) collects what the ranks report and, for processes, watches their exits and
heartbeats (comm/heartbeat.py). When one rank fails, the others are stopped (thread ranks get a CommError at their
next wait; processes fail their next collective, naming the culprit from the detector's verdict, and are then
terminated and reaped: no orphans) and LaunchError names the first rank that failed by time, with its traceback:
a process that died (its signal or exit code), a rank that raised, or a rank that stalled (its peers timed out waiting
while it made no progress; for a process, its Python stack, dumped on SIGUSR1 before it is stopped). An MPI job is
aborted and reports the earliest failure (mpi.py).
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import multiprocessing.connection
import multiprocessing.reduction
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ..comm.thread_backend import ThreadWorld
from ..dropout_functions import rank_thread_stream
from .detector import FailureDetector, error_report
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
    device: str | torch.device | None = None,
) -> list[Any]:
    """Run `fn(comm, *args)` on `world_size` ranks and return the results in rank order.

    backend: "thread" (ranks are threads of this process), "gloo" (spawned processes on 127.0.0.1) or "mpi"
    (processes under `mpirun -np world_size`, each with an MPI Communicator). For processes, `fn`, `args` and the
    results must be picklable, and `fn` must be importable by module and name (or defined in the main script).
    timeout: seconds any collective may wait before raising CommError.
    threads_per_rank: torch intra-op threads of each spawned process (default: cores // world_size, at least 1).
    device: thread ranks only: the device of every rank's `comm.device` (e.g. "cuda:0": all ranks share one GPU, each
        thread made current on it; the multi-rank logic of a strategy on real CUDA tensors). Default cpu.
    Raises LaunchError naming the first rank that failed by time (a process that died: its signal or exit code; a
    rank that raised: its traceback; a rank that stalled while its peers waited) and listing the other ranks' errors.
    A stalled thread rank cannot be stopped: launch returns without it once the others are done.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"launch: world_size={world_size!r} must be a positive int")
    if backend not in LAUNCH_BACKENDS:
        raise ValueError(f"launch: backend={backend!r} is not supported; allowed {LAUNCH_BACKENDS}")
    if not timeout > 0:
        raise ValueError(f"launch: timeout={timeout!r} must be a positive number of seconds")
    if device is not None and backend != "thread" and torch.device(device).type != "cpu":
        raise ValueError(f"launch: device={device!r} is for thread ranks (backend='thread'); {backend} processes "
                         f"choose their device from the backend (gloo: cpu, NCCL under sw.init: the local GPU)")
    if backend == "thread":
        return _launch_threads(fn, world_size, args, timeout, _thread_device(device))
    if backend == "mpi":
        return launch_mpi(fn, world_size, args, timeout, threads_per_rank)
    return _launch_processes(fn, world_size, args, timeout, threads_per_rank)


def _thread_device(device: str | torch.device | None) -> torch.device:
    """The thread ranks' device, with its index (tensors on cuda:0 do not equal a device "cuda")"""
    device = torch.device(device or "cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"launch: device={str(device)!r} but this torch sees no CUDA device; use device='cpu'")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def _launch_threads(fn: Callable[..., Any], n: int, args: tuple, timeout: float, device: torch.device) -> list[Any]:
    world = ThreadWorld(n, timeout, device=device)
    comms = world.communicators()
    results: list[Any] = [None] * n
    raised: dict[int, BaseException] = {}
    detector = FailureDetector(n)

    def run(rank: int) -> None:
        set_log_rank(rank, thread_only=True)
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # the current device is per thread; a new one starts on none
                # Backward on CUDA runs on autograd's one worker thread per device, shared by every rank of this GPU:
                # rank 0's backward would block in a collective while rank 1's waits in the queue behind it. Each
                # rank runs its own backward instead (thread-local).
                torch.autograd.set_multithreading_enabled(False)
            with rank_thread_stream(rank):  # a rank's own dropout masks, as a process's (dropout_stream.py)
                results[rank] = fn(comms[rank], *args)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the caller, named by rank
            raised[rank] = exc
            detector.report_error(rank, error_report(exc))
            world.abort(f"rank {rank} raised {type(exc).__name__}: {exc}", rank=rank)
        else:
            detector.report_done(rank)

    threads = [threading.Thread(target=run, args=(r,), name=f"shardwise-rank{r}", daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    # Every rank returns or fails; after a failure the others are woken by the abort at their next wait. A rank that
    # never gets there (it stalled) is left behind after `settle`: a thread cannot be stopped from outside.
    while True:
        detector.changed.clear()
        if not detector.running() or detector.settled():
            break
        detector.changed.wait(0.05)
    if detector.first_failure() is None:
        for t in threads:
            t.join()  # each has reported; it is only returning
        return results
    error = _launch_error(detector)
    raise error from raised.get(error.rank)


def _launch_error(detector: FailureDetector, stacks: dict[int, str] | None = None) -> LaunchError:
    """LaunchError for the detector's root cause, listing every other failed or abandoned rank."""
    failures = detector.failures()
    root = failures[0]
    others = [(f.rank, f.summary) for f in failures[1:]]
    named = {f.rank for f in failures}
    others += [(r, "still running when the job was stopped") for r in detector.running() if r not in named]
    text = root.traceback or (stacks or {}).get(root.rank) or "(no traceback)"
    return LaunchError(root.rank, root.summary, text, others)


#: What the fork server imports once, before it forks any rank: torch and the library (shardwise imports torch), and
#: torch._dynamo, which every rank that builds a torch optimizer imports anyway (torch wraps
#: `Optimizer.add_param_group` in `torch._disable_dynamo`, whose first call imports it): ~2.7 s of CPU per rank on a
#: 2-core machine, paid once here instead. Importing it starts no thread and runs no torch operation.
_PRELOAD = ["shardwise", "torch._dynamo"]


def _rank_context() -> multiprocessing.context.BaseContext:
    """multiprocessing's fork server with torch and shardwise preloaded, where the platform has one (Linux, macOS);
    spawn elsewhere. The fork server is single-threaded and never runs a torch operation (so no OpenMP pool or CUDA
    context exists to be forked); each rank is a fork of it, started as spawn starts a process (the launcher's sys.path,
    working directory and __main__ module), and from our side exactly a spawned process: a pid, a sentinel, an exit
    code (negative for a signal). The preload applies only if the fork server has not started yet in this process."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class _Stdio:
    """The launcher's standard output and error, duplicated into the rank when it starts (a forked rank would
    otherwise write to the fork server's, which are the launcher's of the moment the fork server started: pytest's
    capture of another test, say)."""

    def __reduce__(self) -> tuple:
        dup = multiprocessing.reduction.DupFd
        return _Stdio._adopt, (dup(1), dup(2))

    @staticmethod
    def _adopt(out: Any, err: Any) -> None:
        for wrapped, target in ((out, 1), (err, 2)):
            fd = wrapped.detach()
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)


def _process_main(
    rank: int, n: int, port: int, token: str, timeout: float, threads: int, logs: bool, fn: Callable, args: tuple,
    out: Any, stack_path: str, environ: dict[str, str], stdio: None,
) -> None:
    """Body of one gloo rank: join the store-hosted rendezvous, run fn, send back the pickled result.

    environ: the launcher's os.environ at launch. stdio: the launcher's stdout/stderr, already made this process's
    fds 1 and 2 by unpickling (`_Stdio`)."""
    from ..comm import rendezvous

    os.environ.clear()
    os.environ.update(environ)
    # The rank's parent: the launcher if spawned, else the fork server, which exits when the launcher does; either
    # way the heartbeat's watchdog ends the rank once that parent is gone.
    launcher_pid = os.getppid()
    stack_file = open(stack_path, "w")  # noqa: SIM115 - held open for faulthandler until the process exits
    if hasattr(faulthandler, "register"):  # the launcher asks a stalled rank for its stack with SIGUSR1
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
         "MASTER_PORT": str(port), rendezvous.JOB_TOKEN_ENV: token}
    )
    torch.set_num_threads(threads)
    start_rank_logging(rank, logs)
    comm = None
    try:
        store = rendezvous.job_store(rendezvous.join_store("127.0.0.1", port, timeout, rank=rank), token)
        comm = rendezvous.join_world("gloo", rank, n, timeout, store=store, local=True, launcher_pid=launcher_pid)
        # Plain pickle copies tensors by value; a torch multiprocessing queue would hand over shared memory that
        # dies with this process.
        message: tuple = ("ok", pickle.dumps(fn(comm, *args)))
        error = None
    except BaseException as exc:  # noqa: BLE001
        message = ("error", error_report(exc))
        error = message[1]["summary"].splitlines()[0]
    # Report before leaving: leaving closes this rank's gloo links, and peers still waiting on them then look up why.
    out.send(message)
    try:
        rendezvous.leave_world(comm, error)
    finally:
        out.close()


def _launch_processes(fn: Callable[..., Any], n: int, args: tuple, timeout: float, threads: int | None) -> list[Any]:
    from ..comm import rendezvous
    from ..comm.heartbeat import Board

    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise ValueError(
            f"launch(backend='gloo') needs a function importable by module and name (defined at module level); "
            f"{fn!r} cannot be pickled: {exc}"
        ) from None
    threads = threads or max(1, (os.cpu_count() or 1) // n)
    logs = rank_logging_installed()
    # The parent hosts the rendezvous store on 127.0.0.1, on a port the OS picks: no free-port race between parallel
    # launches, nothing reachable from another host, and every key under this job's token.
    token = rendezvous.new_job_token()
    host = rendezvous.host_store("127.0.0.1", 0, timeout)
    store = rendezvous.job_store(host, token)
    stacks_dir = tempfile.mkdtemp(prefix="shardwise-launch-")
    ctx = _rank_context()
    pipes = [ctx.Pipe(duplex=False) for _ in range(n)]
    environ = dict(os.environ)
    procs = {
        r: ctx.Process(target=_process_main, name=f"shardwise-rank{r}", daemon=True,
                       args=(r, n, host.port, token, timeout, threads, logs, fn, args, pipes[r][1],
                             os.path.join(stacks_dir, f"rank{r}.stack"), environ, _Stdio()))
        for r in range(n)
    }
    detector = FailureDetector(n, board=Board(store, silence=max(2.0, timeout)), processes=procs)
    try:
        for r, p in procs.items():
            p.start()
            pipes[r][1].close()  # the child holds the writing end; EOF here then means it is gone
        detector.start()
        readers = {pipes[r][0]: r for r in range(n)}
        results: dict[int, Any] = {}
        while len(results) < n and not detector.settled():
            for conn in multiprocessing.connection.wait(list(readers), timeout=0.1):
                rank = readers.pop(conn)
                try:
                    kind, body = conn.recv()
                except (EOFError, OSError):
                    continue  # died without a word: the detector saw its exit
                if kind == "ok":
                    results[rank] = pickle.loads(body)
                    detector.report_done(rank)
                else:
                    detector.report_error(rank, body)
        detector.stop()
        if detector.first_failure() is None:
            for p in procs.values():
                p.join(timeout)
            return [results[r] for r in range(n)]
        stacks = {f.rank: _stack(procs[f.rank], stacks_dir, f.rank) for f in detector.failures() if f.kind == "stalled"}
        raise _launch_error(detector, stacks)
    finally:
        detector.stop()
        _stop_all(procs.values())
        shutil.rmtree(stacks_dir, ignore_errors=True)
        del store, host


def _stack(proc: Any, stacks_dir: str, rank: int) -> str:
    """The Python stack of a live process (faulthandler dump on SIGUSR1), for a rank that stalled."""
    if not proc.is_alive() or not hasattr(faulthandler, "register"):
        return ""
    path = os.path.join(stacks_dir, f"rank{rank}.stack")
    try:
        os.kill(proc.pid, signal.SIGUSR1)
    except OSError:
        return ""
    deadline, text, before = time.monotonic() + 2.0, "", None
    while time.monotonic() < deadline and (not text or text != before):  # until the dump stops growing
        time.sleep(0.1)
        before = text
        with open(path) as f:
            text = f.read()
    return f"(the rank was still running; its Python stack when it was stopped:)\n{text}" if text else ""


def _stop_all(procs: Any) -> None:
    """Terminate every child still running, then kill and reap: no process outlives launch(). Children that never
    started (a `start()` that raised, e.g. a script without an `if __name__ == "__main__"` guard) are skipped, so
    the error that stopped the launch is the one raised, not multiprocessing's assertion on an unstarted child."""
    procs = [p for p in procs if p.pid is not None]
    for p in procs:
        if p.is_alive():
            p.terminate()
            with contextlib.suppress(OSError):
                os.kill(p.pid, signal.SIGCONT)  # a frozen (stopped) rank acts on SIGTERM only once continued
    for p in procs:
        p.join(3)
        if p.is_alive():
            p.kill()
            p.join(5)
