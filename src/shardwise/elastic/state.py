"""`ElasticState`: what an elastic job keeps so that a change of membership loses nothing it learned.

Three tiers, cheapest first (Horovod elastic's `state.commit()` / rollback, with torchft's live recovery and a
sharded checkpoint behind them):
* commit, every `commit_every` steps, in memory: a `Snapshot` (snapshot.py) of this rank's model state, optimizer
  state, step, sampler position, LR scheduler and RNG. The last two commits are kept: ranks that saw a failure one
  collective apart (one finished step s, the other did not) agree on the older one. Cost: 2 x this rank's model
  and optimizer state in memory (plus the neighbour's copy with `redundancy=True`), a copy per commit.
* rollback, on the same world: the state returns to the last commit; the step in progress when a peer failed is
  redone once (the sampler re-reads the same global batch), and no step is applied twice.
* resize, on a new world: the survivors' commits are resharded onto the model rewrapped on the new Communicator
  (reshard.py): replicated state comes from a survivor by broadcast, sharded state from whichever survivor held
  each shard (or its neighbour's copy); what no survivor holds is read from the last on-disk checkpoint, written
  every `checkpoint_every` steps through `sw.save_checkpoint` (loadable on any world size), so at most that many
  steps are lost and redone.

Typical loop (the membership layer, or a test, supplies the new communicator):

    state = sw.elastic.ElasticState(model, opt, sampler=sampler, lr_scheduler=sched, commit_every=1)
    while state.step < total_steps:
        try:
            train_one_step(...); state.step_done()
        except sw.CommError:
            comm = <the new world>; model, opt, sched = rebuild(comm)
            state.resize(comm, model, opt, lr_scheduler=sched)
"""

from __future__ import annotations

import collections
import logging
import os
from typing import Any

import torch
from torch import nn

from .. import layout
from ..checkpoint import load_checkpoint, save_checkpoint
from ..comm.base import Communicator
from .redundancy import exchange_with_neighbour
from .reshard import StateLost, agree_step, jsonable_state, redistribute
from .snapshot import Snapshot, capture, restore

__all__ = ["ElasticState", "SUPPORTED", "check_supported"]

log = logging.getLogger("shardwise.elastic")

SUPPORTED = ("ddp", "zero1", "zero2", "zero3", "fsdp:*")


def check_supported(model: nn.Module) -> None:
    """ValueError unless every strategy applied to `model` is data parallel (DDP, ZeRO-1/2/3, FSDP): a new world
    of another size cannot keep a tensor-parallel or pipeline layout, whose sizes are fixed by the model."""
    names = [r.name for r in layout.strategies(model)]
    bad = [n for n in names if not (n in SUPPORTED or n.startswith("fsdp:"))]
    if bad:
        raise ValueError(f"elastic: the model is wrapped with {' + '.join(names)}; elastic training supports data "
                         f"parallel strategies only ({', '.join(SUPPORTED)}), not {bad} (tensor parallel, pipeline "
                         f"and 3-D layouts are refused for now)")


def _positive(value: Any, what: str, allow_none: bool = False) -> Any:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ElasticState: {what}={value!r} must be a positive int" + (" or None" if allow_none else ""))
    return value


class ElasticState:
    """The training state of an elastic job: model, optimizer, step, sample position, LR scheduler and RNG.

    model / optimizer: wrapped with a data-parallel strategy (or none), the optimizer built after wrapping.
    lr_scheduler: any torch LR scheduler (its state follows the step). sampler: an `elastic.Sampler`, advanced by
    `step_done()`. commit_every: k, steps between in-memory commits. checkpoint_dir / checkpoint_every: K, steps
    between on-disk sharded checkpoints (both or neither). keep_last: checkpoints kept on disk.
    redundancy: each rank also keeps its predecessor's commit (see redundancy.py) so one lost rank loses no shard.
    comm: the world of the model (default: the one its strategies declare), needed for redundancy and checkpoints.
    The constructor commits step 0, so a failure before the first commit rolls back to the start.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, *, lr_scheduler: Any = None,
                 sampler: Any = None, commit_every: int = 1, checkpoint_dir: str | os.PathLike | None = None,
                 checkpoint_every: int | None = None, keep_last: int = 2, redundancy: bool = False,
                 comm: Communicator | None = None, step: int = 0) -> None:
        self.commit_every = _positive(commit_every, "commit_every")
        self.checkpoint_every = _positive(checkpoint_every, "checkpoint_every", allow_none=True)
        if (checkpoint_dir is None) != (checkpoint_every is None):
            raise ValueError(f"ElasticState: checkpoint_dir={checkpoint_dir!r} and checkpoint_every="
                             f"{checkpoint_every!r} go together (both set, or both None)")
        self.checkpoint_dir = checkpoint_dir
        self.keep_last = _positive(keep_last, "keep_last")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"ElasticState: step={step!r} must be a non-negative int")
        self.redundancy = bool(redundancy)
        self.step = step
        self.commits: collections.deque[Snapshot] = collections.deque(maxlen=2)
        self.backups: collections.deque[tuple[int, list[Any]]] = collections.deque(maxlen=2)
        self.resizes = 0
        self._bind(model, optimizer, lr_scheduler, sampler, comm)
        self.commit()

    def _bind(self, model: nn.Module, optimizer: Any, scheduler: Any, sampler: Any, comm: Communicator | None) -> None:
        check_supported(model)
        self.model, self.optimizer, self.lr_scheduler, self.sampler = model, optimizer, scheduler, sampler
        if comm is None and layout.strategies(model):
            comm = layout.model_world(model, "ElasticState")
        self.comm = comm
        if self.redundancy and comm is None:
            raise ValueError("ElasticState: redundancy=True needs the model's communicator (comm=...)")
        if sampler is not None and comm is not None:
            sampler.set_world(comm.rank, comm.size)

    # ---- the three tiers ---------------------------------------------------------------------------------------
    def commit(self) -> None:
        """Copy the current state into memory (collective with redundancy: the ring exchange).

        A commit counts only once complete: when a peer dies during the exchange, neither the snapshot nor a partial
        neighbour copy is kept, so every survivor still agrees on the previous commit, which it holds in full."""
        snap = capture(self.step, self.model, self.optimizer, self.lr_scheduler, self.sampler)
        backup = exchange_with_neighbour(self.comm, snap.pieces()) if self.redundancy else None
        self.commits.append(snap)
        if backup is not None:
            self.backups.append((self.step, backup))

    def rollback(self) -> int:
        """Return to the last commit on the same world (model, optimizer, scheduler, sampler, RNG); returns its step."""
        snap = self.commits[-1]
        restore(snap, self.model, self.optimizer, self.lr_scheduler, self.sampler)
        self.step = snap.step
        return self.step

    def step_done(self) -> None:
        """Call after each optimizer step: counts it, moves the sampler by one global batch, commits every k steps
        and checkpoints every K steps."""
        self.step += 1
        if self.sampler is not None:
            self.sampler.advance()
        if self.step % self.commit_every == 0:
            self.commit()
        if self.checkpoint_every is not None and self.step % self.checkpoint_every == 0:
            self.save()

    def save(self) -> None:
        """Write a sharded checkpoint of the current state (collective); the sampler, scheduler and step go in its
        metadata."""
        save_checkpoint(self.checkpoint_dir, self.model, self.optimizer, step=self.step, comm=self.comm,
                        keep_last=self.keep_last, elastic=self._small_state())

    def _small_state(self) -> dict[str, Any]:
        return {"sampler": None if self.sampler is None else self.sampler.state_dict(),
                "scheduler": None if self.lr_scheduler is None else jsonable_state(self.lr_scheduler.state_dict())}

    def resize(self, comm: Communicator, model: nn.Module, optimizer: torch.optim.Optimizer | None, *,
               lr_scheduler: Any = None, sampler: Any = None) -> dict[str, Any]:
        """Continue on a new world: `model` rewrapped on `comm` (same constructor, same strategy), `optimizer` built
        over it afresh, the scheduler over that optimizer. Collective over `comm`; a newcomer calls it on a state
        made with `ElasticState.joining`. Fills them from the survivors' newest common commit, else from the last
        checkpoint; the sampler continues from the committed position with the new world's share. Returns
        {"step", "source": "survivors" | "checkpoint"}."""
        sampler = self.sampler if sampler is None else sampler
        check_supported(model)
        committed = [s.step for s in self.commits]
        target = agree_step(comm, committed)
        snap = next((s for s in self.commits if s.step == target), None)
        backup = next((b for step, b in self.backups if step == target), None)
        try:
            if target is None:
                raise StateLost("elastic: no survivor holds a commit", [])
            result = redistribute(comm, snap, model, optimizer, lr_scheduler, sampler, backup=backup)
        except StateLost as exc:
            if self.checkpoint_dir is None:
                raise
            log.warning("%s; reading the last checkpoint in %s", exc, self.checkpoint_dir)
            # The world changed, so per-rank strategy state (compression residuals) of the old ranks cannot apply:
            # start it fresh (an optimisation memory, see docs/checkpoints.md), as a resize does.
            extra = load_checkpoint(self.checkpoint_dir, model, optimizer, comm=comm, reset_strategy_state=True)
            small = extra.get("elastic", {})
            if sampler is not None and small.get("sampler") is not None:
                sampler.load_state_dict(small["sampler"])
            if lr_scheduler is not None and small.get("scheduler") is not None:
                lr_scheduler.load_state_dict(small["scheduler"])
            result = {"step": int(extra["step"]), "source": "checkpoint"}
        self.step = result["step"]
        self.commits.clear()
        self.backups.clear()
        self.resizes += 1
        self._bind(model, optimizer, lr_scheduler, sampler, comm)
        self.commit()
        log.info("elastic: continuing at step %d on %d ranks (state from the %s)", self.step, comm.size,
                 result["source"])
        return result

    def release(self) -> None:
        """Drop the references to the model, optimizer and scheduler of a world that failed (the commits stay):
        their hooks hold the failed step's works, and the membership layer can free the old world only once nothing
        holds them. Call `resize` next."""
        self.model = self.optimizer = self.lr_scheduler = self.comm = None

    @classmethod
    def joining(cls, model: nn.Module, optimizer: torch.optim.Optimizer | None, comm: Communicator, *,
                lr_scheduler: Any = None, sampler: Any = None, **options: Any) -> ElasticState:
        """A newcomer's state: it holds no commit, takes everything from the survivors in `resize` (which this
        calls), and then trains like them."""
        state = cls.__new__(cls)
        state.commit_every = _positive(options.pop("commit_every", 1), "commit_every")
        state.checkpoint_every = _positive(options.pop("checkpoint_every", None), "checkpoint_every", allow_none=True)
        state.checkpoint_dir = options.pop("checkpoint_dir", None)
        state.keep_last = _positive(options.pop("keep_last", 2), "keep_last")
        state.redundancy = bool(options.pop("redundancy", False))
        if options:
            raise ValueError(f"ElasticState.joining: unknown options {sorted(options)}")
        state.step, state.resizes = 0, 0
        state.commits, state.backups = collections.deque(maxlen=2), collections.deque(maxlen=2)
        state.model, state.optimizer, state.lr_scheduler, state.sampler, state.comm = model, optimizer, None, sampler, comm
        state.resize(comm, model, optimizer, lr_scheduler=lr_scheduler, sampler=sampler)
        return state
