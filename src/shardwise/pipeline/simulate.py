"""Dry-run a schedule without processes: check it, time it with a cost model, measure its bubble and memory.

Like the simulator of torch.distributed.pipelining, it runs every rank's action list under the rules the executor
keeps (see `actions.py`): a SEND never blocks; a RECV only posts; the compute action that consumes a message waits
until its SEND has happened. Each rank runs its actions in order with its own clock; an action starts when the
rank is free and its inputs have arrived. If at some point no rank can run its next action the schedule deadlocks,
and `DeadlockError` names every rank's blocked action and what it waits for. Before running, `check_schedule`
rejects malformed schedules (a missing or repeated pass, an action on a rank that does not hold its stage, a
backward before its forward, a SEND before the pass that produces it, a RECV after the pass that consumes it, and
sends or receives without a partner).

Cost model: `forward` and `backward` are the times of one microbatch through one rank's share of the model, so
each of a rank's v virtual stages costs forward/v (give per-stage sequences of length p*v for uneven stages).
A split backward costs I = backward * (1 - weight_share) and W = backward * weight_share (the Zero Bubble paper's
even split by default). `latency` is added to every message.

Memory: a microbatch is *in flight* on a rank from its forward until its last backward piece (B, or W when the
backward is split) for that stage; `peak_inflight` is the largest count on any rank (1F1B: p, GPipe: m). For
v > 1 each in-flight pair holds 1/v of a rank's layers. A forward-only schedule (no backward pass anywhere) keeps
no graph, so a microbatch is in flight only during its F (peak 1); `check_schedule` then asks for a forward of
every (stage, microbatch) and the activation messages only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from .actions import Action, Op, Schedule, ScheduleError
from .rendezvous import DeadlockError, run_rendezvous
from .schedules import build_schedule
from .timeline import Event, Timeline

__all__ = ["simulate", "check_schedule", "SimResult", "DeadlockError", "P2P_MODES"]

#: Point-to-point models of `simulate`: buffered sends (gloo, MPI, the thread backend) or NCCL's rendezvous.
P2P_MODES = ("buffered", "rendezvous")

F, B, I, W = Op.FORWARD, Op.BACKWARD, Op.INPUT, Op.WEIGHT


@dataclasses.dataclass(frozen=True)
class SimResult:
    """What `simulate` found. Times are in the units of the cost model.

    bubble: idle fraction of the step, 1 - busy / (p * makespan). bubble_time: mean idle time per rank.
    peak_inflight: the most microbatches (stage-microbatch pairs for v > 1) in flight on any rank;
    peak_inflight_per_rank: the same per rank. timeline: per-rank events (`timeline.plot(path)` draws it).
    """

    schedule: Schedule
    timeline: Timeline
    makespan: float
    bubble: float
    bubble_time: float
    peak_inflight: int
    peak_inflight_per_rank: tuple[int, ...]

    def plot(self, path: str | Path, *, title: str | None = None) -> Path:
        """Gantt picture of the simulated timeline (PNG)."""
        s = self.schedule
        title = title or (f"{s.name}: p={s.n_ranks}, m={s.n_microbatches}, v={s.virtual_stages}, "
                          f"bubble {self.bubble:.1%}, peak in flight {self.peak_inflight}")
        return self.timeline.plot(path, title=title, unit="time (cost units)")


def _costs(name: str, value: float | Sequence[float], n_stages: int, v: int) -> list[float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"simulate: {name}={value!r} must be >= 0")
        return [float(value) / v] * n_stages
    costs = [float(c) for c in value]
    if len(costs) != n_stages or any(c < 0 for c in costs):
        raise ValueError(f"simulate: {name} must be a number or {n_stages} non-negative per-stage numbers, got {value!r}")
    return costs


def _message(a: Action, n_stages: int) -> tuple[str, int, int] | None:
    """The message a compute action consumes from another stage, as (direction, producing stage, microbatch)."""
    if a.op is F and a.stage > 0:
        return ("F", a.stage - 1, a.microbatch)
    if a.op in (B, I) and a.stage < n_stages - 1:
        return ("B", a.stage + 1, a.microbatch)
    return None


def check_schedule(schedule: Schedule) -> None:
    """Raise ScheduleError describing the first problem if `schedule` is malformed (see the module docstring)."""
    m, n_stages = schedule.n_microbatches, schedule.n_stages
    where: dict[tuple[Op, int, int], tuple[int, int]] = {}
    for r, acts in enumerate(schedule.actions):
        for k, a in enumerate(acts):
            if not 0 <= a.stage < n_stages or not 0 <= a.microbatch < m:
                raise ScheduleError(f"rank {r} action {a}: stage must be in 0..{n_stages - 1}, microbatch in 0..{m - 1}")
            if schedule.rank_of(a.stage) != r:
                raise ScheduleError(f"rank {r} action {a}: stage {a.stage} lives on rank {schedule.rank_of(a.stage)}")
            key = (a.op, a.stage, a.microbatch)
            if key in where:
                raise ScheduleError(f"rank {r}: action {a} appears twice")
            where[key] = (r, k)

    forward_only = schedule.forward_only
    if forward_only:
        for r, acts in enumerate(schedule.actions):
            stray = next((a for a in acts if a.op in (Op.SEND_B, Op.RECV_B)), None)
            if stray is not None:
                raise ScheduleError(f"rank {r} action {stray}: a forward-only schedule (no backward pass) sends no "
                                    f"gradients")

    def pos(op: Op, s: int, mb: int) -> int | None:
        found = where.get((op, s, mb))
        return None if found is None else found[1]

    for s in range(n_stages):
        r = schedule.rank_of(s)
        for mb in range(m):
            f, b, i, w = (pos(op, s, mb) for op in (F, B, I, W))
            label = f"stage {s} microbatch {mb} (rank {r})"
            if f is None:
                raise ScheduleError(f"{label}: no forward {Action(F, s, mb)}")
            if forward_only:
                first_back = None
            elif b is None and (i is None or w is None):
                raise ScheduleError(f"{label}: needs a full backward {Action(B, s, mb)} or both {Action(I, s, mb)} "
                                    f"and {Action(W, s, mb)}")
            elif b is not None and (i is not None or w is not None):
                raise ScheduleError(f"{label}: has both a full backward and a split one")
            else:
                first_back = b if b is not None else i
                if first_back < f:
                    raise ScheduleError(f"{label}: backward comes before its forward")
                if b is None and w < i:
                    raise ScheduleError(f"{label}: {Action(W, s, mb)} comes before {Action(I, s, mb)}")
            # Messages this (stage, microbatch) produces: the activation forward, the input gradient backward.
            messages = [(F, Op.SEND_F, Op.RECV_F, s + 1, f)]
            if not forward_only:
                messages.append((B if b is not None else I, Op.SEND_B, Op.RECV_B, s - 1, first_back))
            for op, send, recv, peer, producer in messages:
                if not 0 <= peer < n_stages or schedule.rank_of(peer) == r:
                    stray = pos(send, s, mb)
                    if stray is not None:
                        raise ScheduleError(f"rank {r} action {Action(send, s, mb)}: unmatched send, stage {s} has "
                                            f"no peer stage {peer} on another rank")
                    continue
                sp, rp = pos(send, s, mb), pos(recv, peer, mb)
                peer_rank = schedule.rank_of(peer)
                if sp is None and rp is not None:
                    raise ScheduleError(f"rank {peer_rank} action {Action(recv, peer, mb)}: unmatched receive, rank {r} "
                                        f"never sends {Action(send, s, mb)}")
                if sp is not None and rp is None:
                    raise ScheduleError(f"rank {r} action {Action(send, s, mb)}: unmatched send, rank {peer_rank} never "
                                        f"posts {Action(recv, peer, mb)}")
                if sp is None:
                    raise ScheduleError(f"{label}: {Action(op, s, mb)} produces a tensor for stage {peer} on rank "
                                        f"{peer_rank} but no {Action(send, s, mb)} / {Action(recv, peer, mb)} carries it")
                if sp < producer:
                    raise ScheduleError(f"rank {r}: {Action(send, s, mb)} comes before {Action(op, s, mb)} produced it")
                consumer = pos(F, peer, mb) if op is F else (pos(B, peer, mb) if pos(B, peer, mb) is not None
                                                            else pos(I, peer, mb))
                if consumer is not None and rp > consumer:
                    raise ScheduleError(f"rank {peer_rank}: {Action(recv, peer, mb)} is posted after the pass that "
                                        f"consumes it")
    for (op, s, mb), (r, _) in where.items():
        if op in (Op.RECV_F, Op.RECV_B):
            producer = s - 1 if op is Op.RECV_F else s + 1
            if not 0 <= producer < n_stages or schedule.rank_of(producer) == r:
                raise ScheduleError(f"rank {r} action {Action(op, s, mb)}: unmatched receive, stage {s} has no peer "
                                    f"stage {producer} on another rank")


def simulate(
    schedule: str | Schedule,
    n_stages: int | None = None,
    n_microbatches: int | None = None,
    *,
    forward: float | Sequence[float] = 1.0,
    backward: float | Sequence[float] = 2.0,
    virtual_stages: int = 1,
    weight_share: float = 0.5,
    latency: float = 0.0,
    p2p: str = "buffered",
) -> SimResult:
    """Dry-run `schedule` (a name from SCHEDULES, with n_stages = pipeline ranks p and n_microbatches = m, or a
    Schedule) under the cost model of the module docstring; return its timeline, bubble and peak in-flight count.

    p2p: "buffered" (a SEND never blocks: the rules of `actions.py`) or "rendezvous" (NCCL's rules: unbuffered,
    untagged, one stream per rank, sends and receives posted in batches; see `rendezvous.py`).
    Raises ScheduleError for a malformed schedule and DeadlockError (a ScheduleError) when it cannot finish.
    """
    if isinstance(schedule, str):
        if n_stages is None or n_microbatches is None:
            raise ValueError(f"simulate: schedule={schedule!r} is a name, so n_stages and n_microbatches are required")
        schedule = build_schedule(schedule, n_stages, n_microbatches, virtual_stages)
    elif isinstance(schedule, Schedule):
        for arg, value, have in (("n_stages", n_stages, schedule.n_ranks),
                                 ("n_microbatches", n_microbatches, schedule.n_microbatches)):
            if value is not None and value != have:
                raise ValueError(f"simulate: {arg}={value} but the schedule was made for {have}")
    else:
        raise ValueError(f"simulate: schedule={schedule!r} must be a schedule name or a Schedule")
    if not 0.0 <= weight_share <= 1.0:
        raise ValueError(f"simulate: weight_share={weight_share!r} must be in [0, 1]")
    if p2p not in P2P_MODES:
        raise ValueError(f"simulate: p2p={p2p!r} is not a point-to-point model; allowed {list(P2P_MODES)}")
    check_schedule(schedule)
    p, n, v = schedule.n_ranks, schedule.n_stages, schedule.virtual_stages
    t_f = _costs("forward", forward, n, v)
    t_b = _costs("backward", backward, n, v)
    cost = {F: lambda s: t_f[s], B: lambda s: t_b[s], I: lambda s: t_b[s] * (1.0 - weight_share),
            W: lambda s: t_b[s] * weight_share}

    forward_only = schedule.forward_only
    clock = [0.0] * p
    ptr = [0] * p
    sent: dict[tuple[str, int, int], float] = {}  # message -> time it is available to the receiver
    finished: dict[tuple[Op, int, int], float] = {}
    inflight = [0] * p
    peak = [0] * p
    events: list[Event] = []

    def run(r: int, a: Action, start: float, end: float) -> None:
        events.append(Event(r, str(a), start, end))
        finished[(a.op, a.stage, a.microbatch)] = end
        if a.op is F:
            inflight[r] += 1
            peak[r] = max(peak[r], inflight[r])
        if a.op in (B, W) or forward_only:  # forward-only: nothing is kept after the F
            inflight[r] -= 1

    if p2p == "rendezvous":
        run_rendezvous(schedule, lambda a: cost[a.op](a.stage), latency, run)
        return _result(schedule, events, peak)

    def waiting_for(r: int, a: Action) -> str | None:
        """None if `a` can run now on rank r, else what it waits for."""
        if not a.is_compute or a.op is W:
            return None
        msg = _message(a, n)
        if msg is None:
            return None
        direction, producer, mb = msg
        if schedule.rank_of(producer) == r:  # a local hand-over (p = 1): the producer must already have run
            needed = (F, producer, mb) if direction == "F" else None
            if needed is not None:
                return None if needed in finished else f"{Action(*needed)} on this rank, which comes later"
            if (B, producer, mb) in finished or (I, producer, mb) in finished:
                return None
            return f"the backward of stage {producer} microbatch {mb} on this rank, which comes later"
        if msg in sent:
            return None
        peer = schedule.rank_of(producer)
        op = Op.SEND_F if direction == "F" else Op.SEND_B
        return f"{Action(op, producer, mb)} from rank {peer}"

    while True:
        progressed = False
        for r in range(p):
            acts = schedule.actions[r]
            while ptr[r] < len(acts):
                a = acts[ptr[r]]
                if waiting_for(r, a) is not None:
                    break
                if a.op is Op.SEND_F:
                    sent[("F", a.stage, a.microbatch)] = clock[r] + latency
                elif a.op is Op.SEND_B:
                    sent[("B", a.stage, a.microbatch)] = clock[r] + latency
                elif a.is_compute:
                    msg = _message(a, n)
                    start = max(clock[r], sent.get(msg, 0.0)) if a.op is not W and msg is not None else clock[r]
                    end = start + cost[a.op](a.stage)
                    run(r, a, start, end)
                    clock[r] = end
                ptr[r] += 1
                progressed = True
        if all(ptr[r] == len(schedule.actions[r]) for r in range(p)):
            break
        if not progressed:
            blocked = {}
            for r in range(p):
                if ptr[r] < len(schedule.actions[r]):
                    a = schedule.actions[r][ptr[r]]
                    blocked[r] = f"{a} waits for {waiting_for(r, a)}"
            lines = "; ".join(f"rank {r}: {why}" for r, why in blocked.items())
            raise DeadlockError(f"schedule {schedule.name!r} deadlocks: {lines}", blocked)
    return _result(schedule, events, peak)


def _result(schedule: Schedule, events: list[Event], peak: list[int]) -> SimResult:
    p = schedule.n_ranks
    timeline = Timeline(events, p)
    busy_total = sum(e.duration for e in events)
    makespan = timeline.makespan
    return SimResult(
        schedule=schedule,
        timeline=timeline,
        makespan=makespan,
        bubble=timeline.bubble,
        bubble_time=(p * makespan - busy_total) / p,
        peak_inflight=max(peak),
        peak_inflight_per_rank=tuple(peak),
    )
