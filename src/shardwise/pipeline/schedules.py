"""The schedules: for each rank, the order of its forward and backward passes, plus the sends and receives.

p = pipeline ranks, m = microbatches per step, v = virtual stages per rank; F, B = forward and full backward time
of one microbatch through one rank's share of the model. The bubble is the idle fraction of the step.

* ``gpipe`` (Huang et al. 2019, "GPipe"): every rank runs all m forwards, then all m backwards. Bubble
  (p-1)/(m+p-1); activations of all m microbatches are alive at once.
* ``1f1b`` (Narayanan et al. 2019, "PipeDream"; the flush variant of Narayanan et al. 2021): rank r runs
  p-r-1 warm-up forwards, then alternates one forward and one backward, then drains the remaining backwards.
  Same bubble as GPipe, but at most p microbatches are in flight (activation memory for p, not m).
* ``interleaved_1f1b`` (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM", section 2.2.2): each rank holds v stages (stage s on rank s % p) and runs 1F1B over the
  v*m (stage, microbatch) pairs in Megatron's order, groups of p microbatches per model chunk. The bubble time is
  divided by v, at the cost of v times more point-to-point messages. Needs m to be a multiple of p. In the steady
  state each F and the B after it exchange their messages together, after the B (Megatron's pairing).
* ``zb_h1`` (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", arXiv 2401.10241): the backward is split into
  I (the input gradient, the paper's "B", on the critical path between ranks) and W (the weight gradients,
  which nothing downstream waits for). 1F1B's order of F and I is kept, and rank r postpones up to r of its W
  passes so that they fill the idle time of the drain, which cuts the bubble to about a third of 1F1B's with
  unit costs ((p-1)(F+I-W) instead of (p-1)(F+B)) while no rank has more than p microbatches in flight.
* ``forward_only`` (inference; `Pipeline.predict` runs it): forwards only, no backward, no graph kept. Each rank
  runs its stages' forwards in Megatron's forward order: microbatches in groups of p, each group through the
  rank's v stages in turn (for v = 1 simply F0 .. F(m-1)). Any m and v. Bubble (p-1)/(m+p-1) for v = 1.
  It is not in SCHEDULES (the training schedules) but `build_schedule` and the simulator accept it.

`build_schedule` returns the compute order with SEND/RECV actions added by `add_communication`: a SEND right
after the action that produced the tensor, and a RECV right before the action that consumes it, so that the
sends of one compute action and the receives of the next form one batch, posted together (`batches.py`; the
Megatron-LM / torch.distributed.pipelining pairing that keeps NCCL's unbuffered, in-order point-to-point free
of deadlocks: `simulate(..., p2p="rendezvous")` checks it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .actions import Action, Op, Schedule

__all__ = ["SCHEDULES", "FORWARD_SCHEDULES", "build_schedule", "add_communication", "check_schedule_args"]

F, B, I, W = Op.FORWARD, Op.BACKWARD, Op.INPUT, Op.WEIGHT


def _gpipe(p: int, m: int, v: int) -> list[list[Action]]:
    return [[Action(F, r, i) for i in range(m)] + [Action(B, r, i) for i in range(m)] for r in range(p)]


def _one_f_one_b(p: int, m: int, v: int) -> list[list[Action]]:
    lists = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        acts = [Action(F, r, i) for i in range(warmup)]
        for i in range(m - warmup):
            acts += [Action(F, r, warmup + i), Action(B, r, i)]
        acts += [Action(B, r, i) for i in range(m - warmup, m)]
        lists.append(acts)
    return lists


def _interleaved(p: int, m: int, v: int) -> list[list[Action | tuple[Action, Action]]]:
    """Megatron-LM's interleaved 1F1B (its `forward_backward_pipelining_with_interleaving`)."""
    total = m * v

    def microbatch(k: int) -> int:
        return (k // (p * v)) * p + k % p

    lists = []
    for r in range(p):

        def fwd(k: int) -> Action:
            return Action(F, ((k // p) % v) * p + r, microbatch(k))

        def bwd(k: int) -> Action:
            return Action(B, (v - 1 - (k // p) % v) * p + r, microbatch(k))

        warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
        acts = [fwd(k) for k in range(warmup)]
        for k in range(total - warmup):  # steady state: each F, B pair communicates as one unit (see below)
            acts.append((fwd(warmup + k), bwd(k)))
        acts += [bwd(k) for k in range(total - warmup, total)]
        lists.append(acts)
    return lists


def _zb_h1(p: int, m: int, v: int) -> list[list[Action]]:
    """1F1B with B split into I and W; rank r lets up to r W passes wait, then runs them in the drain."""
    lists = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        acts = [Action(F, r, i) for i in range(warmup)]
        done_i = done_w = 0

        def input_then_maybe_weight() -> None:
            nonlocal done_i, done_w
            acts.append(Action(I, r, done_i))
            done_i += 1
            if done_i - done_w > r:
                acts.append(Action(W, r, done_w))
                done_w += 1

        for f in range(warmup, m):
            acts.append(Action(F, r, f))
            input_then_maybe_weight()
        while done_i < m:
            input_then_maybe_weight()
        acts += [Action(W, r, k) for k in range(done_w, m)]
        lists.append(acts)
    return lists


def _forward_only(p: int, m: int, v: int) -> list[list[Action]]:
    """Groups of p microbatches, each through the rank's stages in order: every dependency (stage s - 1 of the same
    microbatch) comes earlier in the order (group, stage, microbatch) that every rank follows, so no deadlock."""
    groups = [range(g, min(g + p, m)) for g in range(0, m, p)]
    return [[Action(F, c * p + r, mb) for group in groups for c in range(v) for mb in group] for r in range(p)]


#: name -> (builder, needs v == 1, needs v >= 2, needs m >= p, needs m % p == 0)
_BUILDERS: dict[str, tuple[Callable[[int, int, int], list[list[Action]]], bool, bool, bool, bool]] = {
    "gpipe": (_gpipe, True, False, False, False),
    "1f1b": (_one_f_one_b, True, False, True, False),
    "interleaved_1f1b": (_interleaved, False, True, True, True),
    "zb_h1": (_zb_h1, True, False, True, False),
    "forward_only": (_forward_only, False, False, False, False),
}

#: Forward-only (inference) schedules: `build_schedule` and the simulator accept them, `Pipeline.predict` runs them.
FORWARD_SCHEDULES: tuple[str, ...] = ("forward_only",)
#: The training schedules: the names accepted wherever a training schedule is chosen by name.
SCHEDULES: tuple[str, ...] = tuple(name for name in _BUILDERS if name not in FORWARD_SCHEDULES)


def _check_int(where: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {name}={value!r} must be a positive int")
    return value


def check_schedule_args(where: str, name: str, n_ranks: int, n_microbatches: int, virtual_stages: int) -> None:
    """Raise ValueError (naming the argument, its value and what is allowed) unless the schedule can be built."""
    if name not in _BUILDERS:
        raise ValueError(f"{where}: schedule={name!r} is not a schedule; allowed {list(_BUILDERS)}")
    p = _check_int(where, "n_stages", n_ranks)
    m = _check_int(where, "n_microbatches", n_microbatches)
    v = _check_int(where, "virtual_stages", virtual_stages)
    _, single, multi, m_ge_p, m_mod_p = _BUILDERS[name]
    if single and v != 1:
        raise ValueError(
            f"{where}: schedule={name!r} runs one stage per rank but virtual_stages={v}; use "
            f"schedule='interleaved_1f1b' for more than one stage per rank"
        )
    if multi and v < 2:
        raise ValueError(
            f"{where}: schedule={name!r} needs virtual_stages >= 2 (got {v}); partition with virtual_stages=2 or "
            f"more, or use schedule='1f1b'"
        )
    if m_ge_p and m < p:
        raise ValueError(
            f"{where}: schedule={name!r} needs n_microbatches >= the number of pipeline ranks ({p}), got "
            f"n_microbatches={m}; use more microbatches or schedule='gpipe'"
        )
    if m_mod_p and m % p:
        raise ValueError(
            f"{where}: schedule={name!r} needs n_microbatches to be a multiple of the number of pipeline ranks "
            f"({p}), got n_microbatches={m}"
        )


def add_communication(compute: Sequence[Sequence[Action | tuple[Action, ...]]], n_ranks: int,
                      virtual_stages: int) -> list[list[Action]]:
    """Insert SEND/RECV actions into per-rank compute lists (see the module docstring for where they go).

    A message is needed wherever consecutive stages live on different ranks; stages on the same rank (only when
    p = 1) hand tensors over directly. An item of a compute list may be a tuple of actions, one *unit*: its
    receives all come before it and its sends all after it. Interleaved 1F1B's steady state is made of (F, B) units,
    as in Megatron-LM (`send_forward_backward_recv_forward_backward`): with one batch between F and B instead, a
    rank's stream can wait on a gradient whose producer waits on an activation queued behind it, so the schedule
    deadlocks under unbuffered point-to-point for p >= 2 (`simulate(..., p2p="rendezvous")` finds it).
    """
    p, n_stages = n_ranks, n_ranks * virtual_stages
    lists = []
    for r, acts in enumerate(compute):

        def receives(a: Action) -> list[Action]:
            if a.op is F and a.stage > 0 and (a.stage - 1) % p != r:
                return [Action(Op.RECV_F, a.stage, a.microbatch)]
            if a.op in (B, I) and a.stage < n_stages - 1 and (a.stage + 1) % p != r:
                return [Action(Op.RECV_B, a.stage, a.microbatch)]
            return []

        def sends(a: Action) -> list[Action]:
            if a.op is F and a.stage < n_stages - 1 and (a.stage + 1) % p != r:
                return [Action(Op.SEND_F, a.stage, a.microbatch)]
            if a.op in (B, I) and a.stage > 0 and (a.stage - 1) % p != r:
                return [Action(Op.SEND_B, a.stage, a.microbatch)]
            return []

        out: list[Action] = []
        for item in acts:
            # The receives of a unit come right before it, after the sends of the unit before: the two form one
            # batch (batches.py), posted together as Megatron-LM does, which NCCL's unbuffered, in-order
            # point-to-point needs (a receive posted one action early crosses the peer's sends and deadlocks).
            unit = list(item) if isinstance(item, tuple) else [item]
            for a in unit:
                out += receives(a)
            out += unit
            for a in unit:
                out += sends(a)
        lists.append(out)
    return lists


def build_schedule(name: str, n_stages: int, n_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The named schedule for `n_stages` pipeline ranks, `n_microbatches` per step and `virtual_stages` per rank.

    name: one of SCHEDULES ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1") or FORWARD_SCHEDULES ("forward_only",
    any virtual_stages and n_microbatches). Raises ValueError for an unknown name,
    virtual_stages other than 1 for a one-stage-per-rank schedule (or below 2 for interleaved), n_microbatches
    below n_stages where the schedule needs m >= p, or not a multiple of it for interleaved.
    """
    check_schedule_args("build_schedule", name, n_stages, n_microbatches, virtual_stages)
    builder = _BUILDERS[name][0]
    compute = builder(n_stages, n_microbatches, virtual_stages)
    lists = add_communication(compute, n_stages, virtual_stages)
    return Schedule.from_lists(name, lists, n_microbatches=n_microbatches, virtual_stages=virtual_stages)
