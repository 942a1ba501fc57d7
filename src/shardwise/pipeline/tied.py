"""Parameters shared by stages on different ranks (tied weights), kept equal by summing their gradients.

A GPT with ``tie_weights=True`` uses one embedding matrix in its first stage (token lookup) and its last stage
(output head). Split across ranks, each rank holds its own copy and autograd gives each copy only the gradient of
its own use; the single-process gradient is their sum. As Megatron-LM does for the word embeddings (Shoeybi et al.
2019; Narayanan et al. 2021), the ranks holding a tied parameter all-reduce (SUM) its gradient after the step, so
every copy gets the full gradient and, with identical optimizer steps, the copies stay identical. At construction
the copies are broadcast from the lowest rank holding them so they also start equal.

Gradients accumulated over several steps before one optimizer step (`step()` called k times, as a script
accumulating over micro-steps does) must sum only what each step added: a copy's gradient after a step is already
the sum, and summing it again at the next step would count the earlier steps once per holder. So `begin_step` sets
each copy's gradient aside before the step's backward passes and `all_reduce_grads` sums the step's own gradient,
then adds it to what was set aside (in that tensor, which stays the one the optimizer and wrappers hold).

Ties are found by identity: the same Parameter object appearing in stages that live on different ranks (which is
what `partition` of one model built on every rank gives). The ranks of each tie form a sub-communicator (split
from the pipeline communicator, collectively, in the same order on every rank).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..comm.base import Communicator, ReduceOp
from ..sharded_tensor import local
from ..unused import used_anywhere

__all__ = ["TiedParameters"]


class TiedParameters:
    """The tied parameters this rank holds, grouped by the set of ranks sharing them, with their communicators.

    `groups` is a list of (ranks, parameters held here, communicator) for the ties this rank takes part in;
    `names` describes every tie of the pipeline as "stage a <-> stage b: n elements" (for error messages and logs).
    """

    def __init__(self, stages: Sequence[nn.Module], comm: Communicator, rank_of_stage) -> None:
        owners: dict[int, list[int]] = {}  # id(param) -> stages using it, in stage order
        objects: dict[int, nn.Parameter] = {}
        for s, stage in enumerate(stages):
            for p in stage.parameters():
                owners.setdefault(id(p), [])
                if s not in owners[id(p)]:
                    owners[id(p)].append(s)
                objects[id(p)] = p
        by_ranks: dict[tuple[int, ...], list[nn.Parameter]] = {}
        self.names: list[str] = []
        for pid, used_by in owners.items():
            ranks = tuple(sorted({rank_of_stage(s) for s in used_by}))
            if len(ranks) > 1:
                by_ranks.setdefault(ranks, []).append(objects[pid])
                self.names.append(" <-> ".join(f"stage {s}" for s in used_by) + f": {objects[pid].numel()} elements")
        self.groups: list[tuple[tuple[int, ...], list[nn.Parameter], Communicator]] = []
        self._carried: list[tuple[nn.Parameter, torch.Tensor]] = []  # gradients set aside by begin_step
        for ranks in sorted(by_ranks):  # the same order on every rank: split is collective
            if ranks == tuple(range(comm.size)):
                sub = comm
            else:
                sub = comm.split(0 if comm.rank in ranks else None)
            if comm.rank in ranks:
                self.groups.append((ranks, by_ranks[ranks], sub))
        with torch.no_grad():
            for _, params, sub in self.groups:
                for p in params:
                    sub.broadcast(local(p.data), src=0)

    def __bool__(self) -> bool:
        return bool(self.names)

    def begin_step(self) -> None:
        """Set each tied copy's gradient aside (None until this step's backward passes give it one): what earlier
        steps accumulated is summed already (module docstring)."""
        self.abandon_step()
        for _, params, _ in self.groups:
            for p in params:
                if p.requires_grad and p.grad is not None:
                    self._carried.append((p, p.grad))
                    p.grad = None

    def all_reduce_grads(self) -> None:
        """Sum each tied parameter's gradient over the ranks holding it (a missing gradient counts as zero); one
        that no holder used keeps `grad = None`, as in one process (one small all-reduce of flags per group)."""
        for _, params, sub in self.groups:
            trainable = [p for p in params if p.requires_grad]
            used = used_anywhere([p.grad is not None for p in trainable], [sub], sub.device)
            for p, was_used in zip(trainable, used):
                if not was_used:
                    continue
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                sub.all_reduce(p.grad, ReduceOp.SUM)
        for p, carried in self._carried:  # what earlier steps accumulated, summed then
            if p.grad is not None:
                carried.add_(p.grad)
            p.grad = carried
        self._carried = []

    def abandon_step(self) -> None:
        """A step that failed: give each copy back the gradient `begin_step` set aside, adding nothing."""
        for p, carried in self._carried:
            p.grad = carried
        self._carried = []
