"""The MPI backend's progress thread: MPI calls while asynchronous operations are outstanding.

Open MPI advances a non-blocking operation only while the process is inside an MPI call, so without this thread an
all-reduce that DDP issues during backward would not move until the next MPI call, and communication would not
overlap with computation (gloo moves data on background threads of its own).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from mpi4py import MPI

__all__ = ["Progress", "stop_all"]

_started: list[Progress] = []  # MPI is per process, so are the threads that drive it


class Progress:
    """A daemon thread that enters MPI while asynchronous operations of its family of communicators are outstanding.

    While at least one `async_op=True` operation is outstanding (`begin` counted it, `end` not yet), the thread makes
    a cheap MPI call (an Iprobe on the side channel, for a tag nobody sends) every 100 us, backing off to every 1 ms
    and back to 100 us when a new operation is issued; otherwise it sleeps on a condition. It starts with the first
    asynchronous operation. Needs MPI_THREAD_MULTIPLE, mpi4py's default; under a lower thread level there is no
    thread (and operations progress only inside waits).
    """

    _TAG = 3

    def __init__(self, side: Any) -> None:
        self.side = side
        self.outstanding = 0
        self.issued = 0
        self.stopped = False
        self.cond = threading.Condition()
        self.thread: threading.Thread | None = None
        self.enabled = MPI.Query_thread() == MPI.THREAD_MULTIPLE

    def begin(self) -> None:
        """An asynchronous operation was issued: drive MPI until its `end`."""
        if not self.enabled:
            return
        with self.cond:
            self.outstanding += 1
            self.issued += 1
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="shardwise-mpi-progress", daemon=True)
                self.thread.start()
                _started.append(self)
            self.cond.notify()

    def end(self) -> None:
        """The operation counted by `begin` completed."""
        if self.enabled:
            with self.cond:
                self.outstanding -= 1

    def stop(self) -> None:
        """Stop the thread for good (after a failure, and before MPI is finalised at exit)."""
        with self.cond:
            self.stopped = True
            self.cond.notify()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(1.0)

    def _run(self) -> None:
        while True:
            with self.cond:
                while self.outstanding <= 0 and not self.stopped:
                    self.cond.wait()
                if self.stopped:
                    return
            nap, seen = 1e-4, self.issued
            while self.outstanding > 0 and not self.stopped:
                self.side.Iprobe(source=MPI.ANY_SOURCE, tag=self._TAG)  # runs MPI's progress engine
                if self.issued != seen:  # a new operation: poll eagerly again
                    nap, seen = 1e-4, self.issued
                time.sleep(nap)
                nap = min(1e-3, nap * 1.25)


def stop_all() -> None:
    """Stop every progress thread of this process: no MPI call may race with MPI_Finalize."""
    for progress in _started:
        progress.stop()
