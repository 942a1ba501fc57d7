"""How the MPI backend waits with a deadline, says who is missing when it fails, and aborts the job afterwards.

Waiting. MPI has no timeouts, and Open MPI progresses a non-blocking operation only while the process is inside an
MPI call. `Family.poll` therefore polls the operation's requests (`Request.Testall` both checks and drives them):
the first millisecond in a tight loop that yields the CPU between polls (`sched_yield`; on an oversubscribed node a
rank that spins without yielding starves the very peer it waits for), then with naps of at most 2% of the time
waited so far (capped at 1 ms), so a long wait for a slow peer neither burns a core nor slows a long transfer by
more than ~2%.

Saying who is missing. Shortly before the deadline the waiting rank asks each peer it waits for, over a side
channel, what it is doing. A peer that is itself inside a shardwise wait answers with that operation; a peer that is
computing, blocked elsewhere or dead does not answer. That turns "waiting for ranks [1, 2]" into "rank 1 waits in
the same all_reduce, rank 2 did not answer" (MPI alone cannot say who is missing).

Aborting. An MPI operation cannot be cancelled, so after a timeout the communicator (and every communicator split
from the same world) is unusable: `Family.failure` is set and later operations raise CommError at once. The job
must not outlive the error with a peer blocked forever, so when this process exits after such a failure, or after
any uncaught exception, it calls `MPI_Abort` on COMM_WORLD, and mpirun kills every rank and exits non-zero.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from mpi4py import MPI

from .mpi_progress import Progress, stop_all

__all__ = ["Family"]

_SPIN_S = 1e-3  # poll in a tight (yielding) loop this long before napping
_NAP_FRACTION = 0.02  # then nap at most this fraction of the time waited so far
_MAX_NAP_S = 1e-3

_failures: list[str] = []  # MPI itself is per process; so is the decision to abort it


class Family:
    """What a world communicator and everything split from it share: whether an operation failed, CUDA-awareness,
    the progress thread, and a side channel (a duplicate of the root communicator) where ranks inside a wait answer
    "what are you in?" (see the module docstring).
    """

    _ASK, _ANSWER, _LONGEST = 1, 2, 400

    def __init__(self, root: Any, global_ranks: Sequence[int]) -> None:
        self.failure: str | None = None
        self.cuda_aware: bool | None = None
        self.doing: tuple | None = None  # (operation, call number, group) this rank waits in; None outside waits
        self.side = root.Dup()
        self.side_rank = {g: r for r, g in enumerate(global_ranks)}  # world rank -> rank on the side channel
        self.progress = Progress(self.side)
        self._sending: list = []

    def poll(self, done: Callable[[], bool], doing: tuple, peers: Sequence[int], limit: float) -> str | None:
        """Call `done()` until it returns True (then None) or `limit` seconds pass; then the peers' answers, as a
        clause for the error. `doing` is (operation, call number, group), told to peers that ask meanwhile."""
        start = time.monotonic()
        deadline, ask_at = start + limit, start + limit - min(1.0, 0.2 * limit)
        asked = None
        self.doing, outer = doing, self.doing
        try:
            while not done():
                now = time.monotonic()
                if asked is None and now >= ask_at:
                    asked = self._ask(peers)
                if now >= deadline:
                    return self._answers(asked or [])
                waited = now - start
                if waited < _SPIN_S:
                    os.sched_yield()  # ~1 us; time.sleep(0) would nap ~60 us (the kernel's timer slack)
                else:
                    self._serve()
                    time.sleep(min(_MAX_NAP_S, waited * _NAP_FRACTION))
            return None
        finally:
            self.doing = outer

    def fail(self, message: str) -> None:
        """Mark the family unusable after `message`, and have this process abort the job when it exits."""
        self.failure = self.failure or message
        self.progress.stop()
        _failures.append(message)

    def _serve(self) -> None:
        """Answer every pending question with what this rank waits in (called while waits nap)."""
        status = MPI.Status()
        while self.side.Iprobe(source=MPI.ANY_SOURCE, tag=self._ASK, status=status):
            asker = status.Get_source()  # a rank of the side channel, answered on it
            self.side.Recv([bytearray(1), MPI.BYTE], source=asker, tag=self._ASK)
            text = "no shardwise operation"
            if self.doing is not None:
                what, seq, group = self.doing
                text = f"{what} (call #{seq} of group {list(group)})"
            answer = bytearray(text.encode()[: self._LONGEST])
            self._sending.append((self.side.Isend([answer, MPI.BYTE], dest=asker, tag=self._ANSWER), answer))
        self._sending = [(r, b) for r, b in self._sending if not r.Test()]

    def _ask(self, peers: Sequence[int]) -> list:
        asked = []
        for peer in peers:
            buffer, to = bytearray(self._LONGEST), self.side_rank[peer]
            self._sending.append((self.side.Isend([bytearray(1), MPI.BYTE], dest=to, tag=self._ASK), None))
            asked.append((peer, self.side.Irecv([buffer, MPI.BYTE], source=to, tag=self._ANSWER), buffer))
        return asked

    def _answers(self, asked: list) -> str:
        """', rank 1 waits in ..., rank 2 did not answer (...)': the peers' replies, as a clause of the error."""
        parts = []
        for peer, request, buffer in asked:
            status = MPI.Status()
            if request.Test(status):
                parts.append(f"rank {peer} waits in {buffer[: status.Get_count(MPI.BYTE)].decode()}")
            else:
                parts.append(f"rank {peer} did not answer (it is not in a shardwise wait: computing, blocked "
                             f"elsewhere, or dead)")
        return ": " + "; ".join(parts) if parts else ""


def _abort_at_exit() -> None:
    stop_all()
    uncaught = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if not (_failures or uncaught) or not MPI.Is_initialized() or MPI.Is_finalized():
        return
    if MPI.COMM_WORLD.Get_size() == 1:  # nobody to release
        return
    reason = _failures[0] if _failures else f"uncaught {type(uncaught).__name__}: {uncaught}"
    sys.stderr.write(f"[rank {MPI.COMM_WORLD.Get_rank()}] shardwise: aborting the MPI job after: {reason}\n")
    sys.stderr.flush()
    MPI.COMM_WORLD.Abort(1)


# Runs before mpi4py finalises MPI at exit (tests/test_mpi.py checks it): MPI_Finalize with a peer blocked in a
# collective would never return.
atexit.register(_abort_at_exit)
