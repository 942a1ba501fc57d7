"""The simulator's unbuffered mode: a schedule run under NCCL's point-to-point rules.

`simulate(..., p2p="rendezvous")` runs each rank's host steps (`batches.host_steps`) against a model of the
one communication stream a rank has:

* a batch (the sends and receives posted together) joins the rank's stream when the host posts it; it *starts*
  when every batch posted before it on that stream has finished (stream order), and it *finishes* when each of its
  messages has met the matching message of the peer while the peer's batch has started too (an unbuffered
  rendezvous: nothing is buffered, so a send cannot finish before its receive runs, and vice versa);
* messages match without tags, in posting order per pair of ranks; a pair whose n-th send and n-th receive carry
  different messages is a ScheduleError (NCCL would deliver the wrong tensor, or hang on a size mismatch);
* the host does not block on sends; a compute action waits until the batch holding the receive it consumes has
  finished, and the receiver of a stage's first activation waits for the metadata batch that comes before it
  (`batches.metadata_stages`), as the executor does;
* a message takes `latency` from the later of the two batch starts.

When no host step and no batch can make progress the schedule deadlocks under these rules: `DeadlockError` names,
per rank, the action its host is blocked in and what the head of its stream waits for. A schedule that passes this
mode also passes the buffered one (every rule here is at least as strict), so this is the check that a schedule
runs on NCCL. The timing this mode reports includes the waits the rendezvous adds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from .actions import Action, Op, Schedule, ScheduleError
from .batches import consumed_message, host_steps, message_of, metadata_stages

__all__ = ["run_rendezvous", "DeadlockError"]


class DeadlockError(ScheduleError):
    """No rank can make progress: `blocked` maps each stuck rank to a description of what it waits for. Raised by
    both of `simulate`'s point-to-point modes (simulate.py re-exports it); defined here, the lower of the two files."""

    def __init__(self, message: str, blocked: dict[int, str]) -> None:
        super().__init__(message)
        self.blocked = blocked


@dataclasses.dataclass
class _Msg:
    send: bool
    peer: int
    what: tuple  # ("F"/"B", producing stage, microbatch) or ("meta", receiving stage)
    batch: _Batch
    partner: _Msg | None = None

    def text(self) -> str:
        what = (f"metadata for stage {self.what[1]}" if self.what[0] == "meta"
                else f"{'activation' if self.what[0] == 'F' else 'gradient'} of stage {self.what[1]} microbatch "
                     f"{self.what[2]}")
        return f"{'send' if self.send else 'recv'} {what} {'to' if self.send else 'from'} rank {self.peer}"


@dataclasses.dataclass
class _Batch:
    rank: int
    label: str
    msgs: list[_Msg] = dataclasses.field(default_factory=list)
    posted: float = 0.0
    started: float | None = None
    finished: float | None = None


def run_rendezvous(schedule: Schedule, cost: Callable[[Action], float], latency: float,
                   on_compute: Callable[[int, Action, float, float], None]) -> None:
    """Run `schedule` under the rules of the module docstring, calling `on_compute(rank, action, start, end)` for
    each compute action in the order they run; raise DeadlockError (naming each blocked rank) or ScheduleError
    (messages matched in different orders)."""
    p, n = schedule.n_ranks, schedule.n_stages
    programs = [host_steps(acts) for acts in schedule.actions]
    ptr = [0] * p
    clock = [0.0] * p
    streams: list[list[_Batch]] = [[] for _ in range(p)]
    head = [0] * p
    unmatched: dict[tuple[int, int, bool], list[_Msg]] = {}  # (src, dst, is_send) -> messages waiting for a match
    counts: dict[tuple[int, int], int] = {}  # (src, dst) -> messages matched so far
    recv_of: dict[tuple, _Batch] = {}  # message consumed -> the batch holding its receive (on the consumer's rank)
    seen: list[set[int]] = [set() for _ in range(p)]
    meta_wait: list[_Batch | None] = [None] * p  # a batch whose metadata the host waits for before posting the rest
    pending_part2: list[tuple[str, list] | None] = [None] * p

    def match(msg: _Msg, src: int, dst: int) -> None:
        queue = unmatched.setdefault((src, dst, not msg.send), [])
        if not queue:
            unmatched.setdefault((src, dst, msg.send), []).append(msg)
            return
        other = queue.pop(0)
        k = counts[(src, dst)] = counts.get((src, dst), 0) + 1
        if other.what != msg.what:
            sent, got = (msg, other) if msg.send else (other, msg)
            raise ScheduleError(
                f"schedule {schedule.name!r}: messages from rank {src} to rank {dst} are matched in posting order "
                f"(no tags), but message #{k} is {sent.text()} on rank {src} and {got.text()} on rank {dst}")
        msg.partner, other.partner = other, msg

    def post(r: int, label: str, msgs: list[tuple[bool, int, tuple]]) -> _Batch:
        batch = _Batch(r, label, posted=clock[r])
        for is_send, peer, what in msgs:
            msg = _Msg(is_send, peer, what, batch)
            batch.msgs.append(msg)
            match(msg, r, peer) if is_send else match(msg, peer, r)
            if not is_send and what[0] != "meta":
                recv_of[what] = batch
        streams[r].append(batch)
        return batch

    def advance_host(r: int) -> bool:
        moved = False
        prog = programs[r]
        while ptr[r] < len(prog):
            step = prog[ptr[r]]
            if isinstance(step, Action):
                need = consumed_message(step, n)
                if need is not None and schedule.rank_of(need[1]) != r:
                    batch = recv_of.get(need)
                    if batch is None or batch.finished is None:
                        return moved
                    clock[r] = max(clock[r], batch.finished)
                start = clock[r]
                clock[r] = start + cost(step)
                on_compute(r, step, start, clock[r])
            else:
                if meta_wait[r] is None:
                    # Part one: every send (a first activation's metadata just before it) and the metadata of a
                    # first activation received; part two, once that metadata is here: that activation itself.
                    firsts = metadata_stages(step, seen[r])
                    first = {id(a) for a, _ in firsts}
                    described = {stage for a, stage in firsts if a.op is Op.RECV_F}  # shapes known after part one
                    part1, part2 = [], []
                    for a in step:
                        direction, stage, mb, peer = message_of(a, p)
                        is_send = a.op in (Op.SEND_F, Op.SEND_B)
                        if id(a) in first:
                            part1.append((is_send, peer, ("meta", stage + 1)))
                        later = a.op is Op.RECV_F and a.stage in described
                        (part2 if later else part1).append((is_send, peer, (direction, stage, mb)))
                    label = " ".join(str(a) for a in step)
                    batch = post(r, f"batch {label}", part1)
                    if part2:
                        meta_wait[r], pending_part2[r] = batch, (f"batch {label} (after the metadata)", part2)
                if meta_wait[r] is not None:
                    if meta_wait[r].finished is None:
                        return moved
                    clock[r] = max(clock[r], meta_wait[r].finished)
                    meta_wait[r] = None
                    post(r, *pending_part2[r])
            ptr[r] += 1
            moved = True
        return moved

    def advance_stream(r: int) -> bool:
        moved = False
        while head[r] < len(streams[r]):
            batch = streams[r][head[r]]
            if batch.started is None:
                batch.started = max(batch.posted, streams[r][head[r] - 1].finished if head[r] else 0.0)
            ready = [m.partner is not None and m.partner.batch.started is not None for m in batch.msgs]
            if not all(ready):
                return moved
            batch.finished = max([batch.started] + [max(batch.started, m.partner.batch.started) + latency
                                                    for m in batch.msgs])
            head[r] += 1
            moved = True
        return moved

    while True:
        progressed = False
        for r in range(p):
            progressed |= advance_host(r)
        for r in range(p):
            progressed |= advance_stream(r)
        if all(ptr[r] == len(programs[r]) and head[r] == len(streams[r]) for r in range(p)):
            return
        if not progressed:
            blocked = {r: _why(r, programs[r][ptr[r]] if ptr[r] < len(programs[r]) else None,
                               streams[r][head[r]] if head[r] < len(streams[r]) else None, meta_wait[r])
                       for r in range(p) if ptr[r] < len(programs[r]) or head[r] < len(streams[r])}
            lines = "; ".join(f"rank {r}: {why}" for r, why in blocked.items())
            raise DeadlockError(f"schedule {schedule.name!r} deadlocks with unbuffered (rendezvous) "
                                f"point-to-point: {lines}", blocked)


def _why(r: int, step: Action | tuple[Action, ...] | None, batch: _Batch | None, meta: _Batch | None) -> str:
    if step is None:
        host = "host done"
    elif isinstance(step, Action):
        host = f"{step} waits for its receive"
    else:
        host = (f"waits for the metadata before posting the rest of {' '.join(str(a) for a in step)}" if meta
                else "posting")
    if batch is None:
        return host
    pending = [m for m in batch.msgs if m.partner is None or m.partner.batch.started is None]
    what = ", ".join(m.text() + (" (not posted by the peer yet)" if m.partner is None else
                                 f" (queued behind the peer's {_head_label(m.partner.batch)})") for m in pending)
    return f"{host}; its stream is stuck at {batch.label}: {what}"


def _head_label(batch: _Batch) -> str:
    return "earlier batches" if batch.started is None else batch.label
