"""FailureDetector: which rank of a launched job failed first, and how (died, raised, stalled), by time.

A launcher feeds it what each rank reports (`report_done`, `report_error`) and what it sees of the ranks' processes;
`start()` runs a watcher thread that notices a process's exit the moment it happens (its sentinel) and a silent
heartbeat (comm/heartbeat.py: no beat for the board's `silence` seconds, a frozen process), and writes its verdict on
the rank into the job's store, where the survivors' CommErrors read it to name that rank. `first_failure()` is the
root cause, as torchrun's error report has it (the first failure by time), with one refinement:

* Primary failures are what a rank does on its own: it died (its signal or exit code; time: when the exit was
  seen), raised anything but a CommError (time: the raise), or stalled. A rank stalled when a peer's CommError blames
  it and it is still running at the end, neither failed nor returned (time: when that peer began waiting for it); or
  when its heartbeat fell silent.
* A CommError (also as the cause or context of another exception) is a consequence: a survivor of someone else's
  failure. It is the root cause only when no primary failure exists (a genuine deadlock, a peer that returned early).

The root cause is the earliest primary failure, else the earliest CommError. `settled()` says when to decide: once
every rank is accounted for, or `settle` seconds after the first failure was seen (survivors report within a moment;
a stalled rank never does). The same detector serves thread ranks (no processes, no heartbeats) and process ranks.
"""

from __future__ import annotations

import dataclasses
import multiprocessing.connection
import signal
import threading
import time
import traceback as traceback_module
from collections.abc import Mapping
from typing import Any

from ..comm.base import CommError

__all__ = ["Failure", "FailureDetector", "error_report", "exit_summary"]


@dataclasses.dataclass
class Failure:
    """One rank's failure. kind: "died", "raised", "stalled" (primary) or "comm" (a CommError: a consequence).

    time: wall-clock seconds when it happened; summary: one line; traceback: the rank's traceback text (or stack);
    blames / waited / op: for "comm", the peers its CommError names, how long that wait lasted, the operation.
    """

    rank: int
    kind: str
    time: float
    summary: str
    traceback: str = ""
    blames: tuple[int, ...] = ()
    waited: float | None = None
    op: str = ""

    @property
    def primary(self) -> bool:
        return self.kind != "comm"


def error_report(exc: BaseException) -> dict[str, Any]:
    """What a rank sends its launcher about an exception (plain data, picklable): summary, traceback, time, and the
    CommError facts (peers, seconds waited, operation) when a CommError is the exception or caused it."""
    comm, seen = None, set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, CommError):
            comm = {"peers": list(link.peers), "waited": getattr(link, "waited", None), "op": link.op}
            break
        link = link.__cause__ or link.__context__
    return {"summary": f"{type(exc).__name__}: {exc}", "time": time.time(), "comm": comm,
            "traceback": "".join(traceback_module.format_exception(type(exc), exc, exc.__traceback__))}


def exit_summary(exitcode: int) -> str:
    """'killed by SIGKILL' / 'exited with code 3': how a process ended."""
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


class FailureDetector:
    """Collects the failures of an n-rank job and names the root cause (see the module docstring).

    board: the job's heartbeat Board (comm/heartbeat.py), or None (thread ranks); verdicts are written there.
    processes: rank -> multiprocessing.Process to watch, or None.
    settle: seconds to keep collecting after the first failure was seen before `settled()` says decide.
    """

    def __init__(self, world_size: int, *, board: Any = None, processes: Mapping[int, Any] | None = None,
                 settle: float = 1.0, poll: float = 0.1) -> None:
        self.n = world_size
        self.board = board
        self.processes = dict(processes or {})
        self.settle = settle
        self.poll = poll
        self.done: set[int] = set()
        self.failed: dict[int, Failure] = {}
        self.first_seen: float | None = None  # time.monotonic() when the first failure was recorded
        self.changed = threading.Event()  # set whenever something was recorded
        self._lock = threading.Lock()
        self._exited: dict[int, tuple[int, float, float]] = {}  # rank -> (exit code, wall time, monotonic time)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- what the launcher reports --------------------------------------------------------------------------------
    def report_done(self, rank: int) -> None:
        with self._lock:
            self.done.add(rank)
            self.failed.pop(rank, None)  # a result that arrived after its process's exit was seen
        self.changed.set()

    def report_error(self, rank: int, report: dict[str, Any]) -> None:
        """A rank's exception, as `error_report` made it."""
        comm = report.get("comm")
        kind = "comm" if comm is not None else "raised"
        failure = Failure(rank, kind, report["time"], report["summary"], report["traceback"],
                          tuple(comm["peers"]) if comm else (), comm.get("waited") if comm else None,
                          comm.get("op", "") if comm else "")
        self._record(failure, verdict=None if comm else f"raised {report['summary'].splitlines()[0][:300]}")

    def report_exit(self, rank: int, exitcode: int) -> None:
        """A watched process ended. Exit code 0 without a report counts as a death only if no report follows soon
        (the report and the exit race through different channels)."""
        with self._lock:
            if rank in self.done or rank in self.failed:
                return
            self._exited[rank] = (exitcode, time.time(), time.monotonic())
        if exitcode != 0:
            self._died(rank)

    def forget(self, rank: int) -> None:
        """A new process took `rank`'s place (an elastic worker restarted): what the old one did no longer counts,
        and the rank is running again."""
        with self._lock:
            self.done.discard(rank)
            self.failed.pop(rank, None)
            self._exited.pop(rank, None)
            if not self.failed:
                self.first_seen = None
        self.changed.set()

    def _died(self, rank: int) -> None:
        exitcode, when, _ = self._exited[rank]
        summary = exit_summary(exitcode)
        text = f"(no traceback: the process was {summary}" + (")" if exitcode < 0 else " without reporting a result)")
        self._record(Failure(rank, "died", when, summary, text), verdict=summary)

    def _record(self, failure: Failure, verdict: str | None) -> None:
        with self._lock:
            if failure.rank in self.done:
                return
            previous = self.failed.get(failure.rank)
            if previous is not None and previous.kind != "died" and failure.kind == "died":
                return  # the rank's own report is more precise than its exit
            self.failed[failure.rank] = failure
            if self.first_seen is None:
                self.first_seen = time.monotonic()
        if verdict is not None and self.board is not None:
            self.board.mark(failure.rank, verdict)
        self.changed.set()

    # ---- watching -------------------------------------------------------------------------------------------------
    def start(self) -> FailureDetector:
        """Watch the processes' exits and the heartbeats on a daemon thread until `stop()`."""
        self._thread = threading.Thread(target=self._watch, name="shardwise-failure-detector", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _watch(self) -> None:
        while not self._stop.is_set():
            live = {p.sentinel: r for r, p in self.processes.items() if r not in self._exited}
            if live:
                for sentinel in multiprocessing.connection.wait(list(live), timeout=self.poll):
                    rank = live[sentinel]
                    self.processes[rank].join(1)  # reaps it: the sentinel fires a moment before the exit code is read
                    if self.processes[rank].exitcode is not None:
                        self.report_exit(rank, self.processes[rank].exitcode)
            else:
                self._stop.wait(self.poll)
            now = time.monotonic()
            for rank, (code, _, seen) in list(self._exited.items()):
                if code == 0 and now - seen > 0.5 and rank not in self.done and rank not in self.failed:
                    self._died(rank)
            self._check_heartbeats()

    def _check_heartbeats(self) -> None:
        if self.board is None:
            return
        for rank in self.running():
            record = self.board.record(rank)
            if record is None or record.get("state") != "running":
                continue
            quiet = self.board.silent_for(record)
            if quiet > self.board.silence:
                summary = f"stalled: no heartbeat for {quiet:.1f}s (the process froze, or its host is unreachable)"
                self._record(Failure(rank, "stalled", record["t"], summary), verdict=summary)

    # ---- the verdict ----------------------------------------------------------------------------------------------
    def running(self) -> list[int]:
        """Ranks that neither returned nor failed (nor exited)."""
        with self._lock:
            return [r for r in range(self.n) if r not in self.done and r not in self.failed and r not in self._exited]

    def settled(self) -> bool:
        """Whether to decide now: every rank accounted for, or `settle` seconds since the first failure was seen."""
        if self.first_seen is None:
            return False
        return not self.running() or time.monotonic() - self.first_seen >= self.settle

    def failures(self) -> list[Failure]:
        """Every failure, the root cause first, then by time; ranks still running that a CommError blames are
        stalled."""
        with self._lock:
            failed = dict(self.failed)
        running = set(self.running())
        for f in sorted(failed.values(), key=lambda f: f.time):
            if f.kind != "comm":
                continue
            for peer in f.blames:
                if peer in running and peer not in failed:
                    began = f.time - (f.waited or 0.0)
                    waited = f"{f.waited:.1f}s " if f.waited is not None else ""
                    summary = (f"stalled: rank {f.rank} waited {waited}for it in {f.op or 'an operation'} while it "
                               f"made no progress (see rank {f.rank}'s CommError)")
                    failed[peer] = Failure(peer, "stalled", began, summary)
        ordered = sorted(failed.values(), key=lambda f: (f.time, f.rank))
        roots = [f for f in ordered if f.primary] or ordered
        if not roots:
            return []
        return [roots[0]] + [f for f in ordered if f is not roots[0]]

    def first_failure(self) -> Failure | None:
        """The root cause: the earliest primary failure, else the earliest CommError; None while nothing failed."""
        found = self.failures()
        return found[0] if found else None
