"""Strict mode of the thread backend: each rank's operations on a communicator run on one in-order stream.

NCCL's rules, modelled on CPU so that the test suite catches what only a GPU job would hit:

* **One stream per rank and communicator.** An operation (a collective, or a batch of sends and receives posted
  together) *starts* only when every operation this rank issued before it on the same communicator has finished,
  whatever the host does meanwhile (NCCL enqueues them on one CUDA stream). A collective finishes when every rank
  of the group has started it; a batch when each of its messages has met its partner (`strict_p2p.py`: unbuffered,
  untagged, posting order per pair). A batch is one fused group, as `ncclGroupStart/End` (batch_isend_irecv): its
  parts progress together and its Works complete together.
* **Same collective order everywhere**, and **tensors on comm.device** (`collective_order.py`).
* **Deadlocks are errors, at once.** A rank is one thread; when every rank of the world is blocked in a wait that
  no progress can satisfy (all progress is made eagerly, under the world lock, whenever something is posted), the
  world is aborted and every rank raises CommError with a report of what each rank waits for and what its stream is
  stuck at. (A rank that returned while others still wait for it is found by the timeout, as without strict mode.)

Strict mode is the test suite's default (tests/conftest.py sets SHARDWISE_STRICT=1) and a user's opt-in:
`ThreadWorld(n, strict=True)` or `SHARDWISE_STRICT=1` in the environment.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable
from typing import Any

from .base import AnySourceWork, CommError
from .collective_order import History
from .strict_p2p import Batch, P2PEntry, Pairing, transfer
from .thread_world import CollectiveSlot, RankComm, WorldState

__all__ = ["StrictState", "strict_default", "Collective", "StrictWork"]

_ENV = "SHARDWISE_STRICT"


def strict_default() -> bool:
    """Strict mode unless told otherwise: the SHARDWISE_STRICT environment variable ("1"/"0", unset: off)."""
    value = os.environ.get(_ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{_ENV}={value!r} is not a boolean; allowed 1/0, true/false, yes/no, on/off")


class Collective:
    """A collective on a rank's stream: it deposits its argument in the group's slot when it starts."""

    def __init__(self, comm: RankComm, seq: int, slot: CollectiveSlot, arg: Any, finish: Callable,
                 label: str) -> None:
        self.comm, self.seq, self.slot, self.arg, self.finish, self.label = comm, seq, slot, arg, finish, label
        self.started = False

    @property
    def done(self) -> bool:
        return self.slot.done


class StrictState:
    """The streams and pending messages of one strict world (every method runs under the world's lock)."""

    def __init__(self, world: WorldState) -> None:
        self.world = world
        self.streams: dict[tuple[int, int], collections.deque[Collective | Batch]] = {}
        self.pairings: dict[int, Pairing] = {}
        self.histories: dict[int, History] = {}
        self.waiting: dict[int, tuple[Callable[[], bool], str, Callable[[], str]]] = {}

    def history(self, group_id: int) -> History:
        return self.histories.setdefault(group_id, History())

    # ---- posting -------------------------------------------------------------------------------------------------
    def post_collective(self, comm: RankComm, seq: int, slot: CollectiveSlot, arg: Any, finish: Callable,
                        label: str) -> StrictWork:
        """Queue call #seq of comm's group (its slot already holds this rank's signature) on this rank's stream."""
        item = Collective(comm, seq, slot, arg, finish, label)
        self._enqueue(comm, item)
        return StrictWork(self, comm, item, label)

    def post_batch(self, comm: RankComm, ops: list[tuple[bool, Any, int | None, int | None]]) -> list[StrictWork]:
        """ops: (is_send, tensor, peer or None for any source, tag). One fused batch; one Work per op."""
        pairing = self.pairings.setdefault(comm.group.id, Pairing())
        entries = [pairing.entry(send, t, peer, tag, comm.rank) for send, t, peer, tag in ops]
        batch = Batch(comm, entries)
        for e in entries:
            pairing.post(e)
        self._enqueue(comm, batch)
        return [StrictWork(self, comm, batch, e.describe(), e) for e in entries]

    def _enqueue(self, comm: RankComm, item: Collective | Batch) -> None:
        self.streams.setdefault((comm.group.id, comm.rank), collections.deque()).append(item)
        self.progress(comm.group)
        self.world.cond.notify_all()

    # ---- progress ------------------------------------------------------------------------------------------------
    def progress(self, group: Any) -> None:
        """Start and finish everything that can be, until nothing changes (eager, so a wait that is not ready after
        this can only be satisfied by a rank posting something new)."""
        changed = True
        while changed:
            changed = False
            for r in range(len(group.members)):
                queue = self.streams.get((group.id, r))
                while queue:
                    item = queue[0]
                    if not item.started:
                        item.started = changed = True
                        if isinstance(item, Collective):
                            item.slot.args[r] = item.arg
                    if not (self._finish_collective(group, item) if isinstance(item, Collective)
                            else self._finish_batch(group, item)):
                        break
                    changed = True
                    if queue and queue[0] is item:
                        queue.popleft()

    def _finish_collective(self, group: Any, item: Collective) -> bool:
        slot = item.slot
        if slot.done:
            return True
        if slot.error is not None or len(slot.args) < slot.size:
            return False
        try:
            slot.results = item.finish(slot.args) or {}
        except Exception as exc:  # a bad argument seen only when combining: report it to every rank
            slot.error = f"{slot.op} failed while combining: {exc!r}"
            return False
        slot.args = {}
        slot.done = True
        group.slots.pop(item.seq, None)
        for r in range(slot.size):  # every rank has this collective at the head of its stream: it started there
            queue = self.streams.get((group.id, r))
            if queue and isinstance(queue[0], Collective) and queue[0].slot is slot and queue[0] is not item:
                queue.popleft()
        return True

    def _finish_batch(self, group: Any, batch: Batch) -> bool:
        pairing = self.pairings[group.id]
        for e in batch.entries:
            if e.done:
                continue
            if e.partner is None and not e.send and e.peer is None:
                pairing.match_any(e)
            if e.partner is not None and e.partner.batch.started:
                send, recv = (e, e.partner) if e.send else (e.partner, e)
                transfer(send, recv, batch.comm.group_label())
        if not all(e.done for e in batch.entries):
            return False
        batch.done = True
        batch.error = next((e.error for e in batch.entries if e.error), None)
        return True

    # ---- explaining a wait ---------------------------------------------------------------------------------------
    def why(self, comm: RankComm, item: Collective | Batch) -> tuple[str, list[int]]:
        """Why `item` has not finished, and the world ranks it waits for."""
        g = comm.global_ranks
        if not item.started:
            head = self.streams[(comm.group.id, comm.rank)][0]
            return f"it is queued on this rank's stream behind {head.label}, which has not finished", []
        if isinstance(item, Collective):
            parts, never = [], []
            missing = [r for r in range(item.slot.size) if r not in item.slot.args]
            for r in missing:
                queue = self.streams.get((comm.group.id, r), ())
                if any(isinstance(x, Collective) and x.slot is item.slot for x in queue):
                    parts.append(f"rank {g[r]} issued it but its stream is stuck at {queue[0].label}")
                else:
                    never.append(g[r])
            if never:
                parts.insert(0, f"waiting for rank(s) {never}, which never called it")
            return "; ".join(parts) or "every rank started it", [g[r] for r in missing]
        parts, peers = [], []
        for e in item.entries:
            if e.done:
                continue
            if e.partner is None:
                who = "any rank" if e.peer is None else f"rank {g[e.peer]}"
                parts.append(f"{e.describe()}: {who} never "
                             f"{'posted the matching recv' if e.send else 'sent a matching message'}")
                peers += [] if e.peer is None else [g[e.peer]]
            else:
                peer = e.partner.rank
                head = self.streams[(comm.group.id, peer)][0]
                parts.append(f"{e.describe()}: rank {g[peer]} posted the matching {e.partner.describe()} but its "
                             f"stream is stuck at {head.label}")
                peers.append(g[peer])
        return "; ".join(parts), peers

    def deadlock_report(self) -> str | None:
        """A report of every rank's blocked wait when every rank of the world waits and none can go on; else None."""
        world = self.world
        if len(self.waiting) < world.size or any(ready() for ready, _, _ in self.waiting.values()):
            return None
        return "; ".join(f"rank {r} waits in {what}: {blocked()}" for r, (_, what, blocked) in
                         sorted(self.waiting.items()))



class StrictWork(AnySourceWork):
    """Handle of one strict operation: waits until its collective or its whole batch finished."""

    def __init__(self, state: StrictState, comm: RankComm, item: Collective | Batch, describe: str,
                 entry: P2PEntry | None = None) -> None:
        self.state, self.comm, self.item, self.describe, self.entry = state, comm, item, describe, entry

    def _error(self) -> str | None:
        return self.item.slot.error if isinstance(self.item, Collective) else self.item.error

    def is_completed(self) -> bool:
        return self.item.done or self._error() is not None

    def wait(self, timeout: float | None = None) -> None:
        comm, state = self.comm, self.state
        limit = comm.timeout if timeout is None else timeout
        op = self.item.slot.op if isinstance(self.item, Collective) else ("send" if self.entry.send else "recv")

        def timed_out() -> CommError:
            why, peers = state.why(comm, self.item)
            return CommError(f"{self.describe} timed out after {limit:g}s on rank {comm.global_rank}"
                             f"{comm.group_label()} (strict mode): {why}", op=op, rank=comm.global_rank,
                             peers=peers, waited=limit)

        comm.world.wait_until(self.is_completed, limit, timed_out, self.describe, rank=comm.global_rank,
                              blocked=lambda: state.why(comm, self.item)[0])
        error = self._error()
        if error is not None:
            peers = [] if self.entry is None or self.entry.partner is None else [comm.global_ranks[self.entry.partner.rank]]
            raise CommError(f"{error} (seen on rank {comm.global_rank})", op=op, rank=comm.global_rank, peers=peers)

    def result(self) -> Any:
        self.wait()
        return self.item.slot.results.get(self.comm.rank)

    def source(self, timeout: float | None = None) -> int:
        self.wait(timeout)
        return self.entry.source
