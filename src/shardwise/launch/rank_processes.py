"""The supervisor's ranks as operating-system processes: the environment they share, the report a failed one
leaves, the supervisor's own SIGINT / SIGTERM, and teardown (stacks first, SIGTERM to each process group, SIGKILL
after a grace period). Shared by the gloo / nccl path (supervise.py) and the mpirun path (run_mpi.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from typing import Any

from .run_config import BACKEND_ENV, RunConfig
from .run_rank import RUN_DIR_ENV, SUPERVISOR_PID_ENV, report_file
from .run_report import dump_stacks

__all__ = ["POLL_S", "Interrupt", "child_env", "kill_ranks", "read_report", "stop_ranks"]

POLL_S = 0.05  # how often the supervisor looks at its ranks' exits and report files


def child_env(config: RunConfig, run_dir: str) -> dict[str, str]:
    """The environment every rank shares (rank-specific variables are added per process)."""
    import shardwise

    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(shardwise.__file__)))
    paths = [package_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))  # the ranks import the same shardwise as we do
    env[RUN_DIR_ENV] = run_dir
    env[SUPERVISOR_PID_ENV] = str(os.getpid())
    env[BACKEND_ENV] = config.backend
    env.setdefault("PYTHONUNBUFFERED", "1")  # lines reach the terminal as they are printed, also from a killed rank
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    env.setdefault("OMP_NUM_THREADS", str(max(1, cores // config.nproc)))  # torch's intra-op threads per rank
    return env


def read_report(run_dir: str, rank: int) -> dict[str, Any] | None:
    try:
        with open(report_file(run_dir, rank)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


class Interrupt:
    """SIGINT / SIGTERM to the supervisor: remembered, and the job torn down (the ranks are in their own process
    groups, so a Ctrl-C reaches them only through us)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._saved: dict[int, Any] = {}

    def __enter__(self) -> Interrupt:
        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._saved[sig] = signal.signal(sig, self._handle)
        except ValueError:  # not the main thread: nothing to install
            pass
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)


def stop_ranks(procs: dict[int, subprocess.Popen], run_dir: str, config: RunConfig,
               stopping: bool) -> dict[int, str]:
    """Tear down the ranks still running (their stacks first); returns those stacks by global rank."""
    alive = {config.first_rank + r: p for r, p in procs.items() if p.poll() is None}
    if not alive:
        return {}
    stacks = dump_stacks(alive, run_dir) if stopping else {}
    kill_ranks(alive.values(), config.grace)
    return stacks


def kill_ranks(procs: Any, grace: float = 3.0) -> None:
    """SIGTERM each rank's process group (SIGCONT too: a frozen rank acts on it only once continued), SIGKILL
    after `grace` seconds, and reap."""
    procs = [p for p in procs if p.poll() is None]
    for p in procs:
        for sig in (signal.SIGTERM, signal.SIGCONT):
            try:
                os.killpg(p.pid, sig)
            except OSError:
                pass
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
            p.wait(10)
