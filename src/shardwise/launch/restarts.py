"""`shardwise run --max-restarts R`: what the supervisor does when a worker process crashes.

A crash is a process-level failure: a worker that exited with a non-zero code (an exception, `sys.exit(3)`) or was
killed by a signal (the OOM killer's SIGKILL, a segfault). A worker that froze while its process lives is not
restarted (the failure detector names it; the collective timeout ends it). Two semantics, chosen by the job's kind:

* **Elastic job** (`--min/--max`): the crashed worker is replaced by a fresh process with the same launch rank and
  environment (`TORCHELASTIC_RESTART_COUNT` = restarts used so far). It joins the running job like a `--join`
  worker: `Membership.start()` finds the job's published epoch and enters the next one, and `ElasticState.joining`
  gives it the survivors' state. The survivors never stop: they regroup without it at once and take it back in at
  the next step boundary where it waits (comm/membership.py). This is what torchrun cannot do: its agent restarts
  every worker of the group on any membership change. A replacement that arrives after the other workers finished
  finds nothing left to join (`MembershipError`); the supervisor asks the store (`membership.job_finished`) and
  counts it as done, so a crash near the end does not fail a job whose training completed.
* **Fixed-size job**: torchrun's semantics. The failed attempt is torn down as any failure is (the other workers
  stopped, their stacks taken), then every worker starts again on a fresh rendezvous store
  (`TORCHELASTIC_RESTART_COUNT` = the attempt number), and the script resumes from its own checkpoint
  (`sw.load_checkpoint`; `ElasticState(checkpoint_dir=...)` for the sampler's position).

The budget R is job-wide, as torchrun's `--max-restarts`: each replaced worker (elastic) or each restart of the group
(fixed size) spends one. Each restart is logged with the rank, the exit cause and the count left. Once R is spent
the next crash is handled as without restarts: an elastic job goes on without the worker (if at least `min`
remain; below `min` the survivors stop with MembershipError), a fixed-size job fails with the blame report of its
last attempt. R = 0 (the default) is exactly the behaviour without the option. The failure policy of `run`
(`keep_survivors`, `tear_down`) sees only the crashes that no restart answered. With `--backend mpi` (fixed size
only) the restart starts mpirun again.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import TextIO

__all__ = ["RESTART_COUNT_ENV", "MAX_RESTARTS_ENV", "Restart", "RestartBudget"]

#: torchrun's names, so that a script written for torchrun reads how often it was restarted.
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
MAX_RESTARTS_ENV = "TORCHELASTIC_MAX_RESTARTS"


@dataclasses.dataclass(frozen=True)
class Restart:
    """One restart: `rank` the global rank replaced (None: the whole group), `cause` how it ended (one line),
    `number` 1..limit."""

    rank: int | None
    cause: str
    number: int

    def describe(self) -> str:
        who = "all ranks" if self.rank is None else f"rank {self.rank}"
        return f"restart {self.number}: {who} after {self.cause}"


class RestartBudget:
    """The job's `--max-restarts` budget and its history; logs each decision to `out` (the supervisor's lines)."""

    def __init__(self, limit: int, out: TextIO | None = None) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"run: max_restarts={limit!r} must be an int >= 0")
        self.limit = limit
        self.out = out or sys.stderr
        self.history: list[Restart] = []

    @property
    def left(self) -> int:
        return self.limit - len(self.history)

    def _say(self, text: str) -> None:
        print(f"shardwise run: {text}", file=self.out, flush=True)

    def take_worker(self, rank: int, cause: str) -> Restart | None:
        """Spend one restart on elastic worker `rank`, which ended with `cause`; None (logged) when none is left."""
        if self.left <= 0:
            if self.limit:  # with --max-restarts 0 nothing changes, so nothing is said
                self._say(f"rank {rank} {cause}; no restart left ({self.limit} of --max-restarts {self.limit} used): "
                          f"the job goes on without it")
            return None
        restart = Restart(rank, cause, len(self.history) + 1)
        self.history.append(restart)
        self._say(f"rank {rank} {cause}; restarting it to join the running job (restart {restart.number} of "
                  f"{self.limit}, {self.left} left)")
        return restart

    def take_group(self, root_rank: int | None, cause: str, nproc: int) -> Restart | None:
        """Spend one restart on the whole group of a fixed-size job whose root cause was `root_rank` ending with
        `cause`; None (logged) when none is left."""
        who = "the job" if root_rank is None else f"rank {root_rank}"
        if self.left <= 0:
            if self.limit:
                self._say(f"{who} failed ({cause}); no restart left ({self.limit} of --max-restarts {self.limit} "
                          f"used)")
            return None
        restart = Restart(None, f"{who}: {cause}", len(self.history) + 1)
        self.history.append(restart)
        self._say(f"{who} failed ({cause}); restarting all {nproc} rank(s) (restart {restart.number} of "
                  f"{self.limit}, {self.left} left)")
        return restart
