"""Collectives run by a background thread: a Work handle for them, and the thread that runs them in order.

Some collectives of the torch backend are not one torch.distributed call: the ring reduce-scatter over gloo's
point-to-point (gloo_ring.py) and the same-host shared-memory collectives (shm_channel.py) are several steps, and
their asynchronous form must progress while the training thread computes. Each communicator that needs one gets a
`SerialWorker`: a daemon thread that runs submitted jobs one at a time, in submission order. Every rank submits the
same collectives in the same order, so the ranks' workers meet in the same jobs (the property that keeps any
collective from deadlocking). A `ThreadWork` looks like the `torch.distributed.Work` the torch backend wraps
(`wait(timedelta) -> bool`, `is_completed()`), so deadlines, CommError and the failure detector's blame apply as to
every other collective; an error in the worker is re-raised by `wait`.

After a job fails, every later job of the same worker fails at once with that error: the peers' workers may have
stopped at another step of the failed job, so what follows could pair the wrong steps and hang or mix data.

At exit (`stop_workers`, called as a rank leaves its world) every worker finishes the jobs it was given and ends: a
daemon thread still inside a torch call when the interpreter finalizes is ended by a forced unwind, which a C++ frame
that may not throw turns into std::terminate (SIGABRT after a job that succeeded).
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
import weakref
from collections.abc import Callable

__all__ = ["SerialWorker", "ThreadWork", "stop_workers"]

_WORKERS: weakref.WeakSet = weakref.WeakSet()  # every SerialWorker whose thread was started


class ThreadWork:
    """One submitted job: done when the worker thread has finished it (or failed it)."""

    def __init__(self) -> None:
        self.finished = threading.Event()
        self.error: BaseException | None = None

    def is_completed(self) -> bool:
        return self.finished.is_set()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Block until the job is done (True) or `timeout` passed (False); re-raise the job's error."""
        if not self.finished.wait(None if timeout is None else timeout.total_seconds()):
            return False
        if self.error is not None:
            raise self.error
        return True


class SerialWorker:
    """A daemon thread running jobs in submission order (see the module docstring); started on first use."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.failed: BaseException | None = None

    def submit(self, job: Callable[[], None]) -> ThreadWork:
        if self.thread is None:
            self.thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
            self.thread.start()
            _WORKERS.add(self)
        work = ThreadWork()
        self.jobs.put((job, work))
        return work

    def stop(self, timeout: float) -> bool:
        """Let the thread finish the jobs queued before this call, then end (a later submit starts a new one); True
        when it ended within `timeout` seconds."""
        thread, self.thread = self.thread, None
        if thread is None:
            return True
        self.jobs.put(None)
        thread.join(timeout)
        return not thread.is_alive()

    def _serve(self) -> None:
        while True:
            item = self.jobs.get()
            if item is None:
                return
            job, work = item
            if self.failed is not None:
                work.error = RuntimeError(f"{self.name}: an earlier operation failed ({self.failed}); this one "
                                          "was not started")
            else:
                try:
                    job()
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread, which raises CommError
                    work.error = self.failed = exc
            work.finished.set()


def stop_workers(timeout: float) -> list[str]:
    """Stop every started SerialWorker of this process (module docstring), waiting `timeout` seconds in all; the
    names of those still running a job then."""
    deadline = time.monotonic() + timeout
    return [worker.name for worker in list(_WORKERS) if not worker.stop(max(0.0, deadline - time.monotonic()))]
