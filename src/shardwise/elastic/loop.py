"""`sw.elastic.run`: the elastic training loop, membership (comm/membership.py) and `ElasticState` tied together.

Mechanism, per step: at a step boundary (every `poll_every` steps) the members ask whether workers wait to join
(`Membership.poll`, one broadcast); then the user's `train_step` runs and `ElasticState.step_done()` commits. When a
collective raises CommError (a peer died: gloo's broken connection, or a wait that outlived the epoch's timeout), or
joiners wait, the loop drops every reference to the failed world's model and optimizer (`ElasticState.release`: the
strategy's hooks hold the failed step's works, which hold the old process group), enters the next epoch
(`Membership.next_epoch`: survivors and joiners agree on the members and rank order and build a fresh world in
process), rebuilds the model with the user's `build(comm)` and reshards the state onto it (`ElasticState.resize`;
a newcomer's `ElasticState.joining`). The step in progress when the peer failed was never committed: it is redone
once from the last commit, with the same global batch (the sampler's committed position).

The same calls work in a program that writes its own loop (docs/elastic.md shows both).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from ..comm.base import CommError
from ..comm.membership import Membership
from .state import ElasticState

__all__ = ["ElasticRun", "run"]

log = logging.getLogger("shardwise.elastic")


@dataclasses.dataclass
class ElasticRun:
    """What `train_step` sees and `run` returns: the current world's model, optimizer, scheduler and Communicator,
    the sampler, the ElasticState (its `step`), and the timeline: one record per step ({"t": wall time, "step",
    "loss", "world"}) and per epoch ({"t", "epoch", "world", "reason", "source"})."""

    membership: Membership
    sampler: Any
    comm: Any = None
    model: Any = None
    optimizer: Any = None
    lr_scheduler: Any = None
    state: ElasticState | None = None
    timeline: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def step(self) -> int:
        return 0 if self.state is None else self.state.step


def _unpack(built: Any) -> tuple[Any, Any, Any]:
    if not isinstance(built, tuple) or len(built) not in (2, 3):
        raise ValueError(f"elastic.run: build(comm) must return (model, optimizer) or (model, optimizer, "
                         f"lr_scheduler), not {type(built).__name__}")
    return built if len(built) == 3 else (*built, None)


def run(membership: Membership, build: Callable[[Any], tuple], train_step: Callable[[ElasticRun], Any], *,
        sampler: Any, steps: int, poll_every: int = 1, **state_options: Any) -> ElasticRun:
    """Train `steps` optimizer steps on a world whose workers may leave and join (module docstring).

    membership: this worker's `Membership` (started here if it was not). build(comm): the model wrapped on `comm`
    (same constructor and strategy on every world), an optimizer built over it afresh, and optionally an LR scheduler.
    train_step(run): one optimizer step over the sampler's next global batch (`run.sampler.rank_indices()`, with
    `run.sampler.plan`'s accumulation), returning the loss or None; it must not call `step_done`. sampler: an
    `elastic.Sampler`, the same on every worker. poll_every: steps between asks for joiners (0: never grow).
    state_options: `ElasticState` options (commit_every, redundancy, checkpoint_dir, checkpoint_every, ...).
    Returns the ElasticRun; the caller reads the model (a collective such as `sw.full_state_dict` is fine) and then
    calls `membership.close()`. Raises MembershipError when fewer than min_workers remain after its wait_timeout.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"elastic.run: steps={steps!r} must be a non-negative int")
    if isinstance(poll_every, bool) or not isinstance(poll_every, int) or poll_every < 0:
        raise ValueError(f"elastic.run: poll_every={poll_every!r} must be a non-negative int (0: never)")
    if "comm" in state_options:
        raise ValueError("elastic.run: the communicator comes from the membership; do not pass comm=")
    joining_options = {k: v for k, v in state_options.items() if k != "step"}
    ctx = ElasticRun(membership, sampler)
    ctx.comm = membership.comm if membership.comm is not None else membership.start()
    reason, fresh = "start", True
    while True:
        try:
            if fresh:
                ctx.model, ctx.optimizer, ctx.lr_scheduler = _unpack(build(ctx.comm))
                source = _take_state(ctx, state_options, joining_options)
                ctx.timeline.append({"t": time.time(), "epoch": membership.epoch, "world": ctx.comm.size,
                                     "reason": reason, "source": source, "step": ctx.state.step})
                fresh = False
            if ctx.state.step >= steps:
                return ctx
            if poll_every and ctx.state.step % poll_every == 0 and membership.poll():
                reason = "workers wait to join"
            else:
                loss = train_step(ctx)
                ctx.state.step_done()
                ctx.timeline.append({"t": time.time(), "step": ctx.state.step, "world": ctx.comm.size,
                                     "loss": None if loss is None else float(loss)})
                continue
        except CommError as exc:
            reason = str(exc).splitlines()[0][:300]
            log.warning("elastic: epoch %d failed at step %d: %s", membership.epoch, ctx.step, reason)
        # Regroup: nothing may keep the failed world alive (module docstring), then the next epoch.
        if ctx.state is not None:
            ctx.state.release()
        ctx.model = ctx.optimizer = ctx.lr_scheduler = ctx.comm = None
        ctx.comm = membership.next_epoch(reason)
        fresh = True


def _take_state(ctx: ElasticRun, options: dict[str, Any], joining_options: dict[str, Any]) -> str:
    """Give the freshly built model its state: new (the job's first epoch), from the survivors (a newcomer, or a
    survivor whose commits the others no longer share), or resharded from this survivor's own commits."""
    membership = ctx.membership
    if ctx.state is None and membership.everyone_new:
        ctx.state = ElasticState(ctx.model, ctx.optimizer, lr_scheduler=ctx.lr_scheduler, sampler=ctx.sampler,
                                 comm=ctx.comm, **options)
        return "new"
    if ctx.state is None or membership.newcomer:
        ctx.state = ElasticState.joining(ctx.model, ctx.optimizer, ctx.comm, lr_scheduler=ctx.lr_scheduler,
                                         sampler=ctx.sampler, **joining_options)
        return "joined"
    return ctx.state.resize(ctx.comm, ctx.model, ctx.optimizer, lr_scheduler=ctx.lr_scheduler)["source"]
