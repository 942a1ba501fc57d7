"""`shardwise run`: start a user's training script on this node's ranks and supervise them (torchrun's agent, ours).

`run(RunConfig(script, args, nproc=4))` does what torchrun's elastic agent does for one node, with shardwise's own
failure machinery, so that the supervisor (not a peer) decides what a failure means:

1. Rendezvous. Node 0's supervisor hosts the job's TCPStore (comm/rendezvous.py `host_store`: on 127.0.0.1 and a port
   the OS picks for a one-node job; on --master-addr:--master-port, every interface, for several nodes); other nodes'
   supervisors join it. Ranks get TORCHELASTIC_USE_AGENT_STORE=True, so `sw.init()` (and torch's own `env://`)
   connect to that store as clients, exactly as under torchrun, and the store outlives any rank.
2. Ranks. Each local rank is `<python> -m shardwise.launch.run_rank <script> <args>` (run_rank.py) in its own process
   group, with the environment `sw.init()` reads (launch/environment.py): RANK, WORLD_SIZE, LOCAL_RANK,
   LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT, SHARDWISE_BACKEND (gloo | nccl | mpi; init's default
   backend) and SHARDWISE_JOB_TOKEN when set; OMP_NUM_THREADS = cores // nproc unless set. Output is not captured:
   the ranks write to this terminal (tag lines with `sw.get_logger()`). A rank that raises writes its traceback to a
   report file before it exits. With backend "mpi" the ranks are started by `mpirun -np nproc` instead (mpi.py's
   command line) and the MPI library wires them (one node; mpirun's own -H places ranks on several).
3. Watching. A FailureDetector (detector.py) receives each rank's exit: the report of a rank that raised (its
   exception, time and, for a CommError, whom it waited for), the exit code or signal of one that died, and, through
   the ranks' heartbeats in the store (comm/heartbeat.py), the rank that froze. It writes its verdict on a rank into
   the store, where the survivors' CommErrors read it: they fail naming the root cause. With several nodes each
   supervisor also reads the verdicts of the other nodes' ranks, so one node's failure stops every node.
4. Policy. Each failure is handed to `policy(failure, job)`, which returns STOP or CONTINUE. The default,
   `tear_down`, stops the job (what torchrun and mpirun do). `keep_survivors` lets the other ranks run on to their
   own end: the hook for asynchronous and elastic training, whose survivors carry on without the failed rank (the
   job still exits non-zero, naming the failure). Under mpirun, MPI aborts the whole job itself whatever the policy.
5. Teardown. After a STOP, the detector collects reports for `settle` seconds (survivors' CommErrors arrive within a
   moment), then every rank still running is asked for its Python stack (SIGUSR1, faulthandler) and sent SIGTERM (and
   SIGCONT, for a frozen one) to its process group; after `grace` seconds SIGKILL. Nothing outlives `run`: ranks also
   exit on their own when the supervisor dies (run_rank.py's watchdog).
6. Restarts (`max_restarts` R, restarts.py): in an elastic job a worker process that crashed is replaced by a fresh
   one that joins the running job; a fixed-size job restarts every worker (torchrun's semantics). R is job-wide.
7. Report. `RunResult.report()` names the root cause first (the first failure by time, as torchrun's error report and
   `sw.launch`'s LaunchError have it) with its traceback, then each other failed rank with its traceback, then the
   stacks of ranks that were stopped while still running. The exit code is the root cause's (1 for an exception).

The pieces: run_config.py (RunConfig, JobView and the policies, re-exported here), rank_processes.py (the ranks'
environment, reports, teardown), run_mpi.py (the mpirun path), restarts.py (the restart budget), run_report.py
(RunResult), run_rank.py (each rank's wrapper). This module is the gloo / nccl path and the loop over attempts.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, TextIO

from .detector import Failure, FailureDetector, exit_summary
from .rank_processes import POLL_S, Interrupt, child_env, kill_ranks, read_report, stop_ranks
from .restarts import MAX_RESTARTS_ENV, RESTART_COUNT_ENV, RestartBudget
from .run_config import CONTINUE, STOP, FailurePolicy, JobView, RunConfig, keep_survivors, tear_down
from .run_mpi import run_mpi
from .run_rank import TRACEBACK_IN_REPORT_ENV, report_file
from .run_report import RunResult

__all__ = ["CONTINUE", "STOP", "FailurePolicy", "JobView", "RunConfig", "RunResult", "keep_survivors", "run",
           "tear_down"]

_REMOTE_POLL_S = 1.0  # how often a supervisor of a multi-node job reads the other nodes' verdicts


def run(config: RunConfig, policy: FailurePolicy = tear_down, *, out: TextIO | None = None) -> RunResult:
    """Start `config.script` on this node's ranks, supervise them (module docstring) and return the RunResult.

    policy: decides, for each failed rank, whether to STOP the job (default `tear_down`) or let the others CONTINUE.
    out: where the supervisor's own lines go (default sys.stderr); the ranks write to the inherited stdout/stderr.
    """
    out = out or sys.stderr
    run_dir = tempfile.mkdtemp(prefix="shardwise-run-")
    budget = RestartBudget(config.max_restarts, out)
    try:
        with Interrupt() as interrupt:
            for attempt in range(config.max_restarts + 1):
                # A fresh folder per attempt: the reports and stacks of the failed one must not be read as this one's.
                attempt_dir = os.path.join(run_dir, f"attempt{attempt}")
                os.mkdir(attempt_dir)
                if config.backend == "mpi":
                    result = run_mpi(config, policy, attempt_dir, interrupt, out, attempt)
                else:
                    result = _run_ranks(config, policy, attempt_dir, interrupt, out, budget, attempt)
                if config.elastic is not None or result.ok or result.interrupted is not None:
                    break  # an elastic job replaces its workers one by one (in _supervise), never the group
                root = result.failures[0] if result.failures else None
                cause = root.summary.splitlines()[0] if root is not None else (result.unexplained or "failed")
                if budget.take_group(None if root is None else root.rank, cause, config.world_size) is None:
                    break
            result.restarts = tuple(r.describe() for r in budget.history)
            result.max_restarts = config.max_restarts
            return result
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


class _NodeBoard:
    """The job's heartbeat Board seen through this node's local rank numbers (the detector counts 0..nproc-1)."""

    def __init__(self, board: Any, first_rank: int) -> None:
        self.board, self.first_rank, self.silence = board, first_rank, board.silence

    def record(self, local: int) -> dict[str, Any] | None:
        return self.board.record(self.first_rank + local)

    def mark(self, local: int, verdict: str) -> None:
        self.board.mark(self.first_rank + local, verdict)

    def silent_for(self, record: dict[str, Any], now: float | None = None) -> float:
        return self.board.silent_for(record, now)


def _globalize(failure: Failure, first_rank: int) -> Failure:
    return dataclasses.replace(failure, rank=failure.rank + first_rank)


def _localize(report: dict[str, Any], config: RunConfig) -> dict[str, Any]:
    """A rank's report with the peers its CommError names in local numbers (the detector's), others dropped."""
    comm = report.get("comm")
    if comm is None or config.nnodes == 1:
        return report
    lo, hi = config.first_rank, config.first_rank + config.nproc
    return {**report, "comm": {**comm, "peers": [p - lo for p in comm["peers"] if lo <= p < hi]}}


def _run_ranks(config: RunConfig, policy: FailurePolicy, run_dir: str, interrupt: Interrupt,
               out: TextIO, budget: RestartBudget, attempt: int = 0) -> RunResult:
    """gloo / nccl: one process per rank, joined through the store this supervisor hosts (node 0) or joins. Each
    attempt of a fixed-size job hosts a store of its own (torchrun's agent, too, makes a new one per retry), so no key
    of the failed attempt (rendezvous, heartbeats, verdicts) is read by the next."""
    from ..comm import rendezvous
    from ..comm.heartbeat import Board

    token = os.environ.get(rendezvous.JOB_TOKEN_ENV)
    if config.join and not token:
        raise ValueError(f"run: joining a running job needs its token in {rendezvous.JOB_TOKEN_ENV} (the first "
                         f"`shardwise run` of the job prints it)")
    token = token or (rendezvous.new_job_token() if config.nnodes == 1 else None)
    if config.node_rank == 0 and not config.join:
        host = config.master_addr if config.nnodes > 1 else config.master_addr or "127.0.0.1"
        store = rendezvous.host_store(host, config.master_port, config.timeout)
    else:
        store = rendezvous.join_store(config.master_addr, config.master_port, config.timeout, rank=config.first_rank)
    port = store.port
    board = Board(rendezvous.job_store(store, token), silence=config.timeout)
    detector = FailureDetector(config.nproc, board=_NodeBoard(board, config.first_rank), settle=config.settle)
    env = child_env(config, run_dir)
    env.update({"WORLD_SIZE": str(config.world_size), "LOCAL_WORLD_SIZE": str(config.nproc),
                "GROUP_RANK": str(config.node_rank), "MASTER_ADDR": config.master_addr, "MASTER_PORT": str(port),
                "TORCHELASTIC_USE_AGENT_STORE": "True", RESTART_COUNT_ENV: str(attempt),
                MAX_RESTARTS_ENV: str(config.max_restarts)})
    if config.max_restarts == 0 and config.elastic is None:
        env[TRACEBACK_IN_REPORT_ENV] = "1"  # the closing report prints every failure's traceback: ranks say one line
    if token:
        env[rendezvous.JOB_TOKEN_ENV] = token
    print(f"shardwise run: {config.nproc} rank(s) of {config.script} ({config.backend}; ranks "
          f"{config.first_rank}..{config.first_rank + config.nproc - 1} of {config.world_size}; store at "
          f"{config.master_addr}:{port})", file=out, flush=True)
    if config.elastic is not None:
        # The workers form their worlds themselves (comm/membership.py reads SHARDWISE_ELASTIC); a worker added later
        # presents the job's token.
        env["SHARDWISE_ELASTIC"] = f"{config.elastic[0]}:{config.elastic[1]}"
        if not config.join:
            print(f"shardwise run: elastic job ({config.elastic[0]}..{config.elastic[1]} workers); add workers with "
                  f"{rendezvous.JOB_TOKEN_ENV}={token} shardwise run --join --min {config.elastic[0]} --max "
                  f"{config.elastic[1]} --master-addr {config.master_addr} --master-port {port} -n 1 "
                  f"{config.script}", file=out, flush=True)
    procs: dict[int, subprocess.Popen] = {}

    def spawn(local: int, restarts: int = attempt) -> subprocess.Popen:
        rank = config.first_rank + local
        return subprocess.Popen(
            [sys.executable, "-m", "shardwise.launch.run_rank", config.script, *config.args],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(local), RESTART_COUNT_ENV: str(restarts)},
            stdin=subprocess.DEVNULL, start_new_session=True,
        )

    replaced: set[int] = set()
    job_keys = rendezvous.job_store(store, token)

    def replace(local: int, cause: str) -> subprocess.Popen | bool:
        """An elastic worker crashed: a fresh process in its place joins the running job, if the budget allows
        (a Popen). True: nothing to replace, the crashed process was a replacement that came after the job finished
        (its MembershipError says so); it counts as done. False: no restart left."""
        from ..comm.membership import job_finished

        rank = config.first_rank + local
        if local in replaced and job_finished(job_keys):
            print(f"shardwise run: rank {rank}'s replacement ended ({cause}) after the job finished: there was "
                  f"nothing left to join", file=out, flush=True)
            return True
        if budget.take_worker(rank, cause) is None:
            return False
        replaced.add(local)
        try:  # the dead process's report was read; the new one writes its own there if it fails
            os.remove(report_file(run_dir, config.first_rank + local))
        except OSError:
            pass
        return spawn(local, len(budget.history))

    try:
        for local in range(config.nproc):
            procs[local] = spawn(local)
        detector.start()
        stopping = _supervise(config, policy, run_dir, detector, procs, board, interrupt,
                              replace if config.elastic is not None else None)
        detector.stop()
        stacks = stop_ranks(procs, run_dir, config, stopping)
        if config.node_rank == 0 and config.nnodes > 1:
            _wait_for_other_nodes(config, board)  # the store lives in this process: keep it until they are done
        return RunResult.build(detector, config.first_rank, procs, stacks, interrupt.signum, run_dir=run_dir)
    finally:
        detector.stop()
        kill_ranks(procs.values())
        del board, store


def _supervise(config: RunConfig, policy: FailurePolicy, run_dir: str, detector: FailureDetector,
               procs: dict[int, subprocess.Popen], board: Any, interrupt: Interrupt,
               replace: Callable[[int, str], subprocess.Popen | bool] | None = None) -> bool:
    """Watch until every rank exited, or a STOP was decided and the reports settled; returns whether to stop.

    replace(local, cause): an elastic job's restart policy: a new process for a crashed worker, True when the crash
    needs none (a late replacement of a finished job: done), False when it stays a failure."""
    exits: dict[int, int] = {}
    handled: set[int] = set()
    remote_failed: set[int] = set()
    stop, next_remote = False, time.monotonic() + _REMOTE_POLL_S
    while True:
        for local, proc in procs.items():
            code = proc.poll()
            if code is None or local in exits:
                continue
            exits[local] = code
            report = read_report(run_dir, config.first_rank + local)
            if code != 0 and replace is not None and interrupt.signum is None:
                cause = report["summary"].splitlines()[0] if report is not None else exit_summary(code)
                fresh = replace(local, cause if report is None else f"raised {cause}")
                if fresh is True:
                    detector.report_done(local)
                    continue
                if fresh is not False:  # the crash is answered: the new process counts as this rank from now on
                    procs[local] = fresh
                    del exits[local]
                    handled.discard(local)
                    detector.forget(local)
                    continue
            if report is not None:
                detector.report_error(local, _localize(report, config))
            elif code == 0:
                detector.report_done(local)
            else:
                detector.report_exit(local, code)
        if config.nnodes > 1 and time.monotonic() >= next_remote:
            next_remote = time.monotonic() + _REMOTE_POLL_S
            remote_failed |= _remote_failures(config, board)
            stop = stop or bool(remote_failed)  # another node's supervisor decided already; ours follows
        for failure in detector.failures():
            if failure.rank in handled:
                continue
            handled.add(failure.rank)
            view = JobView(config.world_size,
                           tuple(sorted(config.first_rank + r for r in handled)),
                           tuple(sorted(config.first_rank + r for r in detector.done)),
                           tuple(config.first_rank + r for r in detector.running()), tuple(sorted(remote_failed)))
            decision = policy(_globalize(failure, config.first_rank), view)
            if decision not in (STOP, CONTINUE):
                raise ValueError(f"run: the failure policy returned {decision!r}; allowed {STOP!r} or {CONTINUE!r}")
            stop = stop or decision == STOP
        if interrupt.signum is not None:
            return True
        if len(exits) == len(procs):
            return stop
        if stop and (detector.settled() or detector.first_failure() is None):
            return True
        detector.changed.wait(POLL_S)
        detector.changed.clear()


def _remote_failures(config: RunConfig, board: Any) -> set[int]:
    """Ranks of other nodes on which their supervisor wrote a verdict (died, raised, stalled)."""
    mine = range(config.first_rank, config.first_rank + config.nproc)
    return {r for r in range(config.world_size) if r not in mine and board.verdict(r) is not None}


def _wait_for_other_nodes(config: RunConfig, board: Any) -> None:
    """Node 0 hosts the store: before it exits, wait (at most `timeout`) until every other rank published a final
    heartbeat (done / failed), fell silent, or got a verdict."""
    mine = range(config.first_rank, config.first_rank + config.nproc)
    deadline = time.monotonic() + config.timeout
    while time.monotonic() < deadline:
        pending = []
        for r in range(config.world_size):
            if r in mine or board.verdict(r) is not None:
                continue
            record = board.record(r)
            if record is not None and record.get("state") == "running" and board.silent_for(record) < board.silence:
                pending.append(r)
        if not pending:
            return
        time.sleep(0.5)
