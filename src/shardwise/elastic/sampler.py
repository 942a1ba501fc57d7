"""`Sampler`: one global sample order and one global position, whatever the world size.

Mechanism. The sampler owns the order of the whole job, not of one rank: epoch `e` visits the dataset in the
permutation drawn by a torch generator seeded with `seed + e` (the identity with `shuffle=False`), cut into global
batches of `global_batch` samples (an incomplete last batch is dropped, as `drop_last=True` does, so every step
sees exactly G samples). The only state is (epoch, step within the epoch): the number of global batches the job
has *committed*. Rank `r` of a world of `W` takes the contiguous slice [r G/W, (r+1) G/W) of every global batch;
with a fixed per-rank micro-batch `m` that slice is cut into G/(W m) micro-batches, the gradient accumulation. The
averaged gradient of a step is therefore the mean over the same G samples for every W: a world that shrinks from
4 to 3 ranks trains exactly what one process would have trained on the same global batch (Goyal et al. 2017 on
why the global batch, not the per-rank one, fixes the learning dynamics).

Position moves only by `advance()`, which the training loop (or `ElasticState.step_done()`) calls once per
optimizer step: a DataLoader that prefetches (num_workers > 0) reads ahead without moving it, and a step redone
after a failure re-reads the same global batch. After a resize, `set_world(rank, W)` and iterate again: iteration
starts at the committed position, so no sample is skipped or seen twice. The peers' answers to the same problem:
torch's DistributedSampler shards by rank first (a new world size reorders everything), Horovod's ElasticSampler
keeps the indices already processed and reshuffles the rest (an epoch's remainder, not a fixed global batch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch

__all__ = ["Sampler", "StepPlan"]


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """How one rank of a world of `world_size` makes up a global batch.

    per_rank: samples of each global batch this rank trains (global_batch / world_size).
    micro_batch: samples per forward/backward. accumulation: micro-batches per optimizer step (per_rank / micro_batch).
    """

    world_size: int
    per_rank: int
    micro_batch: int
    accumulation: int


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Sampler: {what}={value!r} must be a positive int")
    return value


class Sampler(torch.utils.data.Sampler[int]):
    """A deterministic global sample order with a global position, shared out over a world that may change size.

    data: the dataset (any Sized) or its number of samples. global_batch: G, samples per optimizer step, fixed for
    the whole run. micro_batch: samples per forward on each rank (None: the whole per-rank share G/W, no
    accumulation). seed / shuffle: epoch e uses the permutation seeded with seed + e. world_sizes: the world sizes
    the job may run at (e.g. range(2, 5)), checked now so that a bad G fails at start, not at the first resize.

        sampler = sw.elastic.Sampler(dataset, global_batch=48, micro_batch=4, world_sizes=range(3, 5))
        plan = sampler.set_world(comm.rank, comm.size)
        for batch in sampler.micro_batches():           # plan.accumulation micro-batches, then the step
            ...
        sampler.advance()                               # once per optimizer step (ElasticState.step_done does it)

    `DataLoader(dataset, sampler=sampler, batch_size=plan.micro_batch)` yields the same micro-batches; rebuild it
    after `set_world`.
    """

    def __init__(self, data: Sized | int, *, global_batch: int, micro_batch: int | None = None, seed: int = 0,
                 shuffle: bool = True, world_sizes: Iterable[int] | None = None) -> None:
        n = data if isinstance(data, int) and not isinstance(data, bool) else None
        if n is None:
            if not isinstance(data, Sized):
                raise ValueError(f"Sampler: data={type(data).__name__} must be a Sized dataset or a sample count")
            n = len(data)
        self.n_samples = _positive_int(n, "len(data)")
        self.global_batch = _positive_int(global_batch, "global_batch")
        self.micro_batch = None if micro_batch is None else _positive_int(micro_batch, "micro_batch")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"Sampler: seed={seed!r} must be an int")
        self.seed = seed
        self.shuffle = bool(shuffle)
        if self.global_batch > self.n_samples:
            raise ValueError(f"Sampler: global_batch={global_batch} is more than the {self.n_samples} samples of the "
                             f"data; allowed: 1..{self.n_samples}")
        self.steps_per_epoch = self.n_samples // self.global_batch
        self.epoch = 0
        self.step_in_epoch = 0
        self.rank, self.plan = 0, self.plan_for(1)
        for w in world_sizes or ():
            self.plan_for(w)
        self._order: tuple[int, torch.Tensor] | None = None  # (epoch, permutation) cache

    # ---- world -------------------------------------------------------------------------------------------------
    def allowed_world_sizes(self, up_to: int | None = None) -> list[int]:
        """World sizes that keep the global batch exactly (and the micro-batch, when fixed), up to `up_to`."""
        unit = self.micro_batch or 1
        top = self.global_batch if up_to is None else up_to
        return [w for w in range(1, top + 1) if self.global_batch % (w * unit) == 0]

    def plan_for(self, world_size: int) -> StepPlan:
        """The StepPlan of a world of `world_size`; ValueError naming the allowed sizes when G does not split."""
        w = _positive_int(world_size, "world_size")
        unit = self.micro_batch or 1
        if self.global_batch % (w * unit):
            what = f"world_size x micro_batch = {w} x {unit}" if self.micro_batch else f"world_size={w}"
            raise ValueError(f"Sampler: global_batch={self.global_batch} is not divisible by {what}, so a world of {w} "
                             f"cannot keep the global batch; world sizes allowed: {self.allowed_world_sizes()} "
                             f"(choose a global batch divisible by every size the job may run at, e.g. 12k for 3 and 4)")
        per_rank = self.global_batch // w
        micro = self.micro_batch or per_rank
        return StepPlan(world_size=w, per_rank=per_rank, micro_batch=micro, accumulation=per_rank // micro)

    def set_world(self, rank: int, world_size: int) -> StepPlan:
        """Make this sampler rank `rank` of `world_size`; iteration restarts at the committed position."""
        plan = self.plan_for(world_size)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"Sampler: rank={rank!r} must be an int in [0, {world_size})")
        self.rank, self.plan = rank, plan
        return plan

    # ---- order -------------------------------------------------------------------------------------------------
    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._order is None or self._order[0] != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + epoch)
                perm = torch.randperm(self.n_samples, generator=g)
            else:
                perm = torch.arange(self.n_samples)
            self._order = (epoch, perm)
        return self._order[1]

    def global_batch_indices(self, epoch: int | None = None, step: int | None = None) -> list[int]:
        """The G sample indices of global batch `step` of `epoch` (default: the next one to train), all ranks."""
        epoch = self.epoch if epoch is None else epoch
        step = self.step_in_epoch if step is None else step
        if not 0 <= step < self.steps_per_epoch:
            raise ValueError(f"Sampler: step={step} is outside the epoch's {self.steps_per_epoch} global batches")
        start = step * self.global_batch
        return self._permutation(epoch)[start : start + self.global_batch].tolist()

    def rank_indices(self, epoch: int | None = None, step: int | None = None) -> list[int]:
        """This rank's share (plan.per_rank indices) of a global batch (default: the next one)."""
        everything = self.global_batch_indices(epoch, step)
        lo = self.rank * self.plan.per_rank
        return everything[lo : lo + self.plan.per_rank]

    def micro_batches(self) -> Iterator[list[int]]:
        """This rank's micro-batches from the committed position to the end of the epoch, `plan.accumulation` per
        global batch. Does not move the position: call `advance()` after each optimizer step."""
        epoch, plan = self.epoch, self.plan
        for step in range(self.step_in_epoch, self.steps_per_epoch):
            share = self.rank_indices(epoch, step)
            for k in range(plan.accumulation):
                yield share[k * plan.micro_batch : (k + 1) * plan.micro_batch]

    def __iter__(self) -> Iterator[int]:
        for batch in self.micro_batches():
            yield from batch

    def __len__(self) -> int:
        return (self.steps_per_epoch - self.step_in_epoch) * self.plan.per_rank

    # ---- position ----------------------------------------------------------------------------------------------
    @property
    def position(self) -> int:
        """Global batches committed since the start of the run (all epochs)."""
        return self.epoch * self.steps_per_epoch + self.step_in_epoch

    @property
    def samples_seen(self) -> int:
        """Samples committed since the start of the run, over all ranks."""
        return self.position * self.global_batch

    def advance(self, steps: int = 1) -> None:
        """Record `steps` optimizer steps as done: the position moves by steps x G samples (into the next epoch at
        the end of one)."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"Sampler.advance: steps={steps!r} must be a non-negative int")
        total = self.position + steps
        self.epoch, self.step_in_epoch = divmod(total, self.steps_per_epoch)

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its first global batch (for loops written for DistributedSampler)."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"Sampler.set_epoch: epoch={epoch!r} must be a non-negative int")
        if epoch != self.epoch:
            self.epoch, self.step_in_epoch = epoch, 0

    def state_dict(self) -> dict[str, Any]:
        """The position and what defines the order (JSON-serialisable: a checkpoint's `extra` can hold it)."""
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "seed": self.seed, "shuffle": self.shuffle,
                "global_batch": self.global_batch, "n_samples": self.n_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position. The order must be the same one (seed, shuffle, G, dataset size): a
        different one would silently re-read or skip samples, so it raises naming what differs."""
        mine = self.state_dict()
        missing = [k for k in mine if k not in state]
        if missing:
            raise ValueError(f"Sampler.load_state_dict: the state lacks {missing}")
        differ = [f"{k}: saved {state[k]!r}, here {mine[k]!r}"
                  for k in ("seed", "shuffle", "global_batch", "n_samples") if state[k] != mine[k]]
        if differ:
            raise ValueError("Sampler.load_state_dict: the saved sample order differs from this sampler's ("
                             + "; ".join(differ) + ")")
        epoch, step = state["epoch"], state["step_in_epoch"]
        if not (isinstance(epoch, int) and epoch >= 0 and isinstance(step, int) and 0 <= step < self.steps_per_epoch):
            raise ValueError(f"Sampler.load_state_dict: epoch={epoch!r}, step_in_epoch={step!r} out of range "
                             f"(step_in_epoch in [0, {self.steps_per_epoch}))")
        self.epoch, self.step_in_epoch = epoch, step
