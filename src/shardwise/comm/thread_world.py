"""The shared state of N thread ranks (thread_backend.py's world): groups, their collective slots, the mailboxes of
buffered point-to-point, and the one condition variable every wait sleeps on.

The bottom of the thread backend's files, importing none of them: strict_p2p.py, strict_stream.py and
thread_mailbox.py build on this state, and thread_backend.py on all of them (its `ThreadWorld` adds the ranks'
Communicators and the strict streams to `WorldState`). What those layers read of a rank's Communicator and of the
strict streams is spelled here as two Protocols (`RankComm`, `StrictWatch`), so no file needs one above it.

`ThreadWorld.wait_until` is the only place a thread rank blocks: it re-checks its predicate on every notification,
raises the operation's own CommError at the deadline, a CommError naming the failed rank once the world is aborted
(`abort`, how `launch` stops the others when one rank fails), and, in strict mode, a deadlock report as soon as
every rank waits in vain (strict_stream.py).
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from .base import CommError

__all__ = ["WorldState", "ThreadGroup", "CollectiveSlot", "RankComm", "StrictWatch"]


class RankComm(Protocol):
    """What the layers below thread_backend.py read of a rank's Communicator (`ThreadCommunicator` has it all)."""

    world: WorldState
    group: ThreadGroup
    rank: int
    global_rank: int
    global_ranks: tuple[int, ...]
    timeout: float
    device: torch.device

    def group_label(self) -> str: ...


class StrictWatch(Protocol):
    """What `WorldState.wait_until` asks of strict mode (strict_stream.StrictState): who waits, and whether every
    rank waits in vain."""

    waiting: dict[int, tuple[Callable[[], bool], str, Callable[[], str]]]

    def deadlock_report(self) -> str | None: ...


class ThreadGroup:
    """Shared state of one group of thread ranks: its members (world ranks) and its open collective slots."""

    def __init__(self, world: WorldState, group_id: int, members: tuple[int, ...]) -> None:
        self.world = world
        self.id = group_id
        self.members = members
        self.slots: dict[int, CollectiveSlot] = {}


class CollectiveSlot:
    """One collective call of one group: what each rank brought, and the outcome."""

    def __init__(self, op: str, size: int) -> None:
        self.op = op
        self.size = size
        self.signatures: dict[int, str] = {}
        self.args: dict[int, Any] = {}
        self.results: dict[int, Any] = {}
        self.done = False
        self.error: str | None = None


class WorldState:
    """The shared state of `size` thread ranks (thread_backend.ThreadWorld adds their Communicators and sets `strict`
    to the strict streams in strict mode)."""

    def __init__(self, size: int, timeout: float = 60.0, *, device: torch.device | str = "cpu") -> None:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"ThreadWorld: size={size!r} must be a positive int")
        if not timeout > 0:
            raise ValueError(f"ThreadWorld: timeout={timeout!r} must be a positive number of seconds")
        self.size = size
        self.timeout = float(timeout)
        self.device = torch.device(device)
        #: NCCL's rules (strict_stream.StrictState) or None: buffered, tagged point-to-point
        self.strict: StrictWatch | None = None
        self.cond = threading.Condition()
        self.abort_reason: str | None = None
        self.abort_rank: int | None = None
        # Buffered point-to-point: per (group, src, dst, tag) the n-th message sent waits in mailboxes[key][n] for
        # the n-th receive posted (matching in posting order, as MPI); `message_order` is the arrival order
        # (receive-from-any takes the earliest).
        self.mailboxes: dict[tuple[int, int, int, int], dict[int, tuple[int, torch.Tensor]]] = {}
        self.sent: collections.Counter[tuple[int, int, int, int]] = collections.Counter()
        self.claimed: collections.Counter[tuple[int, int, int, int]] = collections.Counter()
        self.message_order = itertools.count()
        self._group_ids = itertools.count()
        self.world_group = self.new_group(tuple(range(size)))

    def new_group(self, members: tuple[int, ...]) -> ThreadGroup:
        return ThreadGroup(self, next(self._group_ids), members)

    def abort(self, reason: str, rank: int | None = None) -> None:
        """Make every current and future wait raise CommError carrying `reason`, naming `rank` (the one that failed)."""
        with self.cond:
            if self.abort_reason is None:
                self.abort_reason, self.abort_rank = reason, rank
            self.cond.notify_all()

    def wait_until(self, ready: Callable[[], bool], timeout: float, describe: Callable[[], CommError],
                   what: str = "", *, rank: int | None = None, blocked: Callable[[], str] | None = None) -> None:
        """Wait (holding no lock on return) until ready() is true; raise describe() on timeout, or a CommError
        saying why the world was aborted (`what`: the operation, for that message). In strict mode a waiting
        `rank` is registered with what it is `blocked` on, so that a world where every rank waits in vain is
        reported as a deadlock at once (strict_stream.py)."""
        deadline = (start := time.monotonic()) + timeout
        strict = self.strict if rank is not None else None
        with self.cond:
            try:
                while not ready():
                    if self.abort_reason is not None:
                        err = describe()
                        peers = err.peers if self.abort_rank is None else (self.abort_rank,)
                        waited = time.monotonic() - start
                        raise CommError(f"{what or err.op} on rank {err.rank} stopped after {waited:.2f}s (aborted: "
                                        f"{self.abort_reason})", op=err.op, rank=err.rank, peers=peers, waited=waited)
                    if strict is not None:
                        strict.waiting[rank] = (ready, what, blocked or (lambda: "?"))
                        report = strict.deadlock_report()
                        if report is not None:
                            err = describe()
                            reason = f"deadlock, every rank waits and none can go on (strict mode): {report}"
                            self.abort(reason)
                            raise CommError(f"{what} on rank {rank}: {reason}", op=err.op, rank=rank,
                                            peers=err.peers, waited=time.monotonic() - start)
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise describe()
                    self.cond.wait(remaining)
            finally:
                if strict is not None:
                    strict.waiting.pop(rank, None)
