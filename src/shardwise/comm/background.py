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
"""

from __future__ import annotations

import datetime
import queue
import threading
from collections.abc import Callable

__all__ = ["SerialWorker", "ThreadWork"]


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
        work = ThreadWork()
        self.jobs.put((job, work))
        return work

    def _serve(self) -> None:
        while True:
            job, work = self.jobs.get()
            if self.failed is not None:
                work.error = RuntimeError(f"{self.name}: an earlier operation failed ({self.failed}); this one "
                                          "was not started")
            else:
                try:
                    job()
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread, which raises CommError
                    work.error = self.failed = exc
            work.finished.set()
