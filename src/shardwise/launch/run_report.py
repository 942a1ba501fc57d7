"""What `shardwise run` says at the end: which rank failed first and why, every failed rank's traceback, the stacks of
the ranks it had to stop, and the exit code (supervise.py)."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
from collections.abc import Mapping

from .detector import Failure, FailureDetector
from .run_rank import stack_file

__all__ = ["RunResult", "dump_stacks", "main_thread_frames"]

_SHOWN = 8  # tracebacks printed in full; a 64-rank job would otherwise print 63 copies of one CommError


def _exit_code(returncode: int | None) -> int:
    """A process's exit status as a shell reports it: its code, or 128 + the signal that killed it."""
    if returncode is None or returncode == 0:
        return 1
    return returncode if returncode > 0 else 128 - returncode


@dataclasses.dataclass
class RunResult:
    """How the job ended. failures: every failed rank (global numbers), the root cause first, then by time.
    stopped: ranks still running when the supervisor tore the job down, with their Python stacks (may be "").
    unexplained: a failure no rank reported (mpirun exited non-zero with no report). exit_code: 0 on success; else
    the root cause's exit status (1 for an exception, 128 + N for a signal), 128 + N when the supervisor itself got
    signal N. restarts: the `--max-restarts` restarts spent (one line each; restarts.py), max_restarts the budget."""

    exit_code: int
    failures: list[Failure]
    stopped: dict[int, str]
    unexplained: str | None = None
    interrupted: int | None = None
    restarts: tuple[str, ...] = ()
    max_restarts: int = 0

    @classmethod
    def build(cls, detector: FailureDetector, first_rank: int, procs: Mapping[int, subprocess.Popen],
              stacks: Mapping[int, str], signum: int | None, *, unexplained: str | None = None,
              exit_code: int | None = None, run_dir: str | None = None) -> RunResult:
        failures = [dataclasses.replace(f, rank=f.rank + first_rank) for f in detector.failures()]
        if run_dir is not None:
            failures = [_with_fatal_dump(f, run_dir) for f in failures]
        stopped = {first_rank + r: stacks.get(first_rank + r, "") for r in detector.running()}
        if signum is not None:
            code = 128 + signum
        elif failures:
            proc = procs.get(failures[0].rank - first_rank)
            code = _exit_code(proc.returncode if proc is not None else exit_code)
        elif unexplained is not None:
            code = _exit_code(exit_code)
        else:
            code = 0
        return cls(code, failures, stopped, unexplained, signum)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def report(self) -> str:
        """The supervisor's closing text (empty on success)."""
        lines: list[str] = []
        if self.interrupted is not None:
            lines.append(f"shardwise run: stopped by {signal.Signals(self.interrupted).name}")
        if self.unexplained:
            lines.append(f"shardwise run: {self.unexplained}")
        if self.failures:
            root = self.failures[0]
            lines.append(f"shardwise run: rank {root.rank} failed first: {root.summary}")
            lines.append(f"--- traceback of rank {root.rank} (the root cause) ---")
            lines.append(root.traceback.rstrip() or "(no traceback)")
            for f in self.failures[1:_SHOWN]:
                lines.append(f"--- rank {f.rank} failed too: {f.summary.splitlines()[0] if f.summary else f.kind} ---")
                if not (f.kind == "comm" and root.rank in f.blames):  # a wait on the root cause: its line says all
                    lines.append(f.traceback.rstrip() or "(no traceback)")
            if len(self.failures) > _SHOWN:
                lines.append(f"--- and {len(self.failures) - _SHOWN} more failed ranks: " +
                             ", ".join(f"rank {f.rank}: {f.summary.splitlines()[0]}"
                                       for f in self.failures[_SHOWN:]))
        if self.restarts:
            lines.append(f"shardwise run: {len(self.restarts)} of --max-restarts {self.max_restarts} restart(s) used: "
                         + "; ".join(self.restarts))
        if self.stopped:
            lines.append(f"shardwise run: stopped rank(s) {sorted(self.stopped)}, still running when the job was torn "
                         f"down")
            for rank in sorted(self.stopped)[:_SHOWN]:
                frames = main_thread_frames(self.stopped[rank])
                if not frames:
                    continue
                if self.interrupted is not None:  # the user stopped it: where it was is enough
                    lines.append(f"    rank {rank} was at{frames[0].strip().removeprefix('File')}")
                else:
                    lines.append(f"--- Python stack of rank {rank} when it was stopped ---")
                    lines.extend(frames)
        if lines:
            lines.append(f"shardwise run: exit code {self.exit_code}")
        return "\n".join(lines)


def main_thread_frames(stack: str) -> list[str]:
    """The frames of the main thread of a faulthandler dump (`dump_stacks`), most recent first, without the launcher's
    own (runpy's and run_rank's): the user's code. shardwise's helper threads (heartbeat, watchdog) are left out -
    they idle in a wait in every dump and said nothing but took 80 lines of a 2-rank job's Ctrl-C."""
    blocks = [b for b in stack.split("\n\n") if b.strip()]
    # The main thread runs run_rank's main(); the thread faulthandler calls "Current" is the one the signal landed on.
    main = next((b for b in blocks if "run_rank.py" in b and " in main" in b),
                next((b for b in blocks if b.lstrip().startswith("Current thread")), blocks[-1] if blocks else ""))
    return [line for line in main.splitlines()[1:] if line.strip()
            and "<frozen runpy>" not in line and not line.strip().endswith(("in _run_module_as_main",))
            and "shardwise/launch/run_rank.py" not in line]


def _with_fatal_dump(failure: Failure, run_dir: str) -> Failure:
    """A rank a signal killed (SIGABRT from a C++ std::terminate, SIGSEGV): faulthandler (run_rank.py) wrote each
    Python thread's stack to the rank's stack file, which says where every thread was."""
    if failure.kind != "died":
        return failure
    try:
        with open(stack_file(run_dir, failure.rank)) as f:
            text = f.read()
    except OSError:
        return failure
    start = text.find("Fatal Python error")
    if start < 0:
        return failure
    return dataclasses.replace(failure, traceback=f"{failure.traceback}\n{text[start:].rstrip()}".lstrip())


def dump_stacks(procs: Mapping[int, subprocess.Popen], run_dir: str, wait: float = 2.0) -> dict[int, str]:
    """Ask each running rank (global rank -> process) for its Python stack (SIGUSR1; run_rank.py registered
    faulthandler on it) and read the dumps once they stop growing, within `wait` seconds in all."""
    asked = []
    for rank, proc in procs.items():
        try:
            os.kill(proc.pid, signal.SIGUSR1)
            asked.append(rank)
        except OSError:
            pass
    texts: dict[int, str] = {}
    deadline, before = time.monotonic() + wait, None
    while asked and time.monotonic() < deadline:
        time.sleep(0.1)
        for rank in asked:
            try:
                with open(stack_file(run_dir, rank)) as f:
                    texts[rank] = f.read()
            except OSError:
                texts[rank] = ""
        if all(texts.values()) and texts == before:
            break
        before = dict(texts)
    return texts
