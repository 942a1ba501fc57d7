"""The Work handles of the torch.distributed backend (torch_backend.py) and the CommError of a failed wait.

A torch.distributed Work is waited with shardwise's deadline, never torch's defaults: `TorchWork.wait()` blocks the
host for at most the communicator's timeout and turns torch's assorted timeout and connection errors into a
CommError that names the operation, this rank, the ranks it waited for and, when the job runs a heartbeat
(heartbeat.py), which of them looks dead or stuck (`wait_error`). On CUDA a wait without a timeout makes the compute
stream wait instead of the host (streams.py); its deadline is checked at the communicator's next issue
(`PendingWork`), where `overdue_error` names it. A finishing step (`then`: AVG's division, a ring's copy-out) runs
once the operation is known complete.

The handle is given what it needs from its communicator (streams, the pending list, the heartbeat's activity
record, the communicator's `fail` which builds the error and aborts an NCCL group) rather than reaching into it.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from .base import AnySourceWork, CommError, Work
from .heartbeat import RankWatch
from .streams import CommStreams, PendingWork

__all__ = ["TorchWork", "AnySourceTorchWork", "wait_error"]

#: fail(what, limit, exc, peers, began, start) -> the CommError to raise (torch_backend.TorchCommunicator's)
Fail = Callable[..., CommError]


class TorchWork(Work):
    """Wraps a torch.distributed Work: waits with a deadline, rewraps errors, then runs a finishing step.

    `peers` are the global ranks the operation waits for (the rest of the group; the one peer of a send / recv).
    """

    def __init__(self, work: dist.Work, what: str, then: Callable[[], None] | None, peers: Sequence[int], *,
                 timeout: float, fail: Fail, streams: CommStreams, pending: PendingWork, activity: Any = None,
                 global_ranks: Sequence[int] = ()) -> None:
        self.work, self.what, self.then, self.peers = work, what, then, peers
        self.timeout, self.fail, self.streams, self.pending = timeout, fail, streams, pending
        self.activity, self.global_ranks = activity, global_ranks
        self.done = False
        self.issued = time.monotonic()

    def is_completed(self) -> bool:
        return self.done or self.work.is_completed()

    def wait(self, timeout: float | None = None) -> None:
        """On CUDA without `timeout`: order the compute stream after the collective (no host block; the deadline is
        checked at the communicator's next issue). Otherwise block the host for at most `timeout` (default: the
        communicator's) seconds."""
        if self.done:
            return
        if timeout is None and self.streams.enabled:
            self._wait_on_stream()
            return
        limit = self.timeout if timeout is None else timeout
        activity = self.activity
        if activity is not None:
            activity.enter(self.what, self.global_ranks)
        began, start = time.time(), time.monotonic()
        try:
            ok = self.work.wait(datetime.timedelta(seconds=limit))
        except CommError:  # the shared-memory channel's own (a call mismatch, named): as it is
            if activity is not None:
                activity.fail()
            raise
        except Exception as exc:  # torch raises RuntimeError / DistBackendError subclasses with backend text
            ok, error = False, exc
        else:
            error = None
        if ok is False:
            if activity is not None:
                activity.fail()  # first, so that peers diagnosing meanwhile see a fellow victim
            raise self.fail(self.what, limit, error, self.peers, began, start) from error
        if activity is not None:
            activity.leave()
        if self.then is not None:
            self.then()
        self.done = True

    def _wait_on_stream(self) -> None:
        try:
            self.streams.wait(self.work)
        except Exception as exc:  # an error the backend already knows of (an aborted communicator, a failed peer)
            raise self.fail(self.what, self.timeout, exc, self.peers, start=self.issued) from exc
        self.pending.add(self.work, self.issued + self.timeout, self)
        if self.then is not None:
            self.then()  # queued on the compute stream, after the wait
        self.done = True

    def overdue_error(self) -> CommError:
        """The CommError of a stream-waited collective found unfinished after its deadline."""
        return self.fail(self.what, self.timeout, None, self.peers, start=self.issued)


class AnySourceTorchWork(AnySourceWork):
    """A receive from any source: the process group's work knows the sender (`_source_rank`, a rank of the group)."""

    def __init__(self, inner: TorchWork) -> None:
        self.inner = inner

    def is_completed(self) -> bool:
        return self.inner.is_completed()

    def wait(self, timeout: float | None = None) -> None:
        self.inner.wait(timeout if timeout is not None else self.inner.timeout)  # a host wait: we need the rank

    def source(self, timeout: float | None = None) -> int:
        self.wait(timeout)
        return int(self.inner.work._source_rank())


def wait_error(what: str, limit: float, exc: BaseException | None, peers: Sequence[int], *, global_rank: int,
               global_ranks: Sequence[int], backend: str, watch: RankWatch | None, began: float | None = None,
               start: float | None = None) -> CommError:
    """The CommError of a failed wait of `what`: the culprits among `peers` (narrowed by the heartbeat `watch` when
    the job runs one) and why. began / start: when the wait began (wall clock / monotonic); None for a call that
    failed while being issued."""
    peers = list(peers)
    start = time.monotonic() if start is None else start
    waited = time.monotonic() - start
    cause = str(exc).splitlines()[0].split(". This is typically")[0][:300] if exc is not None and str(exc) else ""
    timed_out = exc is None or waited >= 0.95 * limit or "timed out" in cause.lower()
    clause = ""
    if watch is not None and peers:
        peers, clause = watch.culprits(peers, global_ranks, time.time() - waited if began is None else began,
                                       early=not timed_out, deadline=start + limit)
        clause = f": {clause}"
    detail = f" [{backend}: {type(exc).__name__}: {cause}]" if exc is not None else ""
    how = (f"timed out after {limit:g}s on rank {global_rank}" if timed_out else
           f"failed on rank {global_rank} after {waited:.2f}s (limit {limit:g}s)")
    return CommError(f"{what} {how}, waiting for rank(s) {peers} of group {list(global_ranks)}{clause}{detail}",
                     op=what.split("(")[0], rank=global_rank, peers=peers, waited=waited)
