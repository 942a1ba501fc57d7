"""`shardwise run --backend mpi`: `mpirun -np nproc` starts the ranks (mpi.py's command line, each rank
`<python> -m shardwise.launch.run_rank <script> <args>`), and the supervisor watches mpirun and the ranks' report
files instead of each process: MPI aborts the whole job itself when a rank exits non-zero, whatever the policy, so
the policy's decision only stops mpirun earlier (after the reports settled). One attempt per call; supervise.run
restarts it under --max-restarts."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import TextIO

from .detector import FailureDetector
from .rank_processes import POLL_S, Interrupt, child_env, kill_ranks, read_report
from .restarts import MAX_RESTARTS_ENV, RESTART_COUNT_ENV
from .run_config import STOP, FailurePolicy, JobView, RunConfig
from .run_report import RunResult

__all__ = ["run_mpi"]


def run_mpi(config: RunConfig, policy: FailurePolicy, run_dir: str, interrupt: Interrupt,
            out: TextIO, attempt: int = 0) -> RunResult:
    """backend "mpi": `mpirun -np nproc` starts the ranks; each reports an exception through its file, and mpirun's
    exit tells the rest (MPI aborts the whole job when a rank exits non-zero)."""
    from .mpi import mpirun_command

    command = [*mpirun_command(config.nproc), sys.executable, "-m", "shardwise.launch.run_rank", config.script,
               *config.args]
    print(f"shardwise run: {config.nproc} rank(s) of {config.script} under {command[0]}", file=out, flush=True)
    detector = FailureDetector(config.nproc, settle=config.settle)
    env = {**child_env(config, run_dir), RESTART_COUNT_ENV: str(attempt), MAX_RESTARTS_ENV: str(config.max_restarts)}
    proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    reported: set[int] = set()
    stop = False
    try:
        while proc.poll() is None and interrupt.signum is None and not (stop and detector.settled()):
            for rank in range(config.nproc):
                report = None if rank in reported else read_report(run_dir, rank)
                if report is not None:
                    reported.add(rank)
                    detector.report_error(rank, report)
                    failure = next(f for f in detector.failures() if f.rank == rank)
                    view = JobView(config.world_size, tuple(sorted(reported)), (),
                                   tuple(r for r in range(config.nproc) if r not in reported))
                    stop = policy(failure, view) == STOP or stop
            time.sleep(POLL_S)
        kill_ranks([proc], config.grace)
        code = proc.wait()
        for rank in range(config.nproc):
            report = None if rank in reported else read_report(run_dir, rank)
            if report is not None:
                detector.report_error(rank, report)
        if code == 0:  # mpirun succeeded: every rank that reported nothing returned (none was left running)
            for rank in range(config.nproc):
                if rank not in reported:
                    detector.report_done(rank)
        unexplained = None
        if detector.first_failure() is None and code != 0 and interrupt.signum is None:
            unexplained = (f"mpirun exited with code {code} and no rank reported an exception (a rank died or "
                           f"exited with a non-zero code without raising; mpirun's message above names it)")
        return RunResult.build(detector, 0, {}, {}, interrupt.signum, unexplained=unexplained, exit_code=code)
    finally:
        kill_ranks([proc])
