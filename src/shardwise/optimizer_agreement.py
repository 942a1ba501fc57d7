"""The data-parallel ranks' optimizers step with the same hyperparameters, or the step raises naming the difference.

A learning rate set from a per-rank figure differs across the ranks: `ReduceLROnPlateau.step(loss)` with each rank's
own validation loss, a warmup counted in each rank's own tokens, `if loss < best: lr *= 0.5`. Under DDP the replicas
then step apart; under ZeRO / FSDP each rank steps its own piece at its own rate, so the model is a patchwork of
rates. Neither is one process's, and nothing fails (ReduceLROnPlateau on each rank's loss: rates 0.00125 and 0.000625
after six steps of two ranks, under DDP, ZeRO-2 and ZeRO-3 alike; torch DDP does not check either).

The optimizer guard (optimizer_guard.py) calls `HyperparameterAgreement.check` before every step of an optimizer
over parameters of a data-parallel model (sw.DDP, sw.ZeRO, sw.FSDP, and those `sw.parallelize` builds). At the first
step and every `EVERY`-th after it, the ranks of each data-parallel group compare the optimizer's param groups with
their parameters left out (lr, betas, eps, weight_decay, momentum, ...) by `agreement.check_agreement`: one
all-gather of an 8-byte digest per rank, and only on a difference the descriptions themselves, to name the first
entry that differs and the ranks; control traffic, not counted in `comm.stats` (comm/uncounted.py). A rate that
starts to differ is caught within `EVERY` steps; the steps between cost nothing. Every rank of the group steps the
optimizer as often (it holds the same parameters), so the checks line up.

On a group whose collectives are not checked one by one (NCCL; gloo or MPI with SHARDWISE_CHECK_COLLECTIVES=0) the
same checks also compare the running hash of the collectives each rank issued on the group, and on each group the
strategy communicates over besides (hybrid_shard's shard and replica groups; `issued_digest`, comm/labels.py):
ranks whose forwards ran other layers (LayerDrop from each rank's own generator, an evaluation on one rank) paired
one rank's gathers with another's, silently where the sizes agree; the first check raises before that step is
applied, a later divergence within `EVERY` steps.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from .agreement import check_agreement
from .comm.base import Communicator
from .comm.uncounted import uncounted

__all__ = ["EVERY", "HyperparameterAgreement"]

EVERY = 20
ADVICE = ("each rank would step its parameters at its own rate, which no one process does. Set hyperparameters "
          "from figures every rank shares: reduce a per-rank metric over the data-parallel ranks "
          "(comm.all_reduce(loss, sw.ReduceOp.AVG)) before passing it to a scheduler such as "
          "ReduceLROnPlateau.step(loss)")
ORDER_ADVICE = ("the ranks issued different collectives on this group since it was formed, so some paired one "
                "rank's data with another's (NCCL checks no call): run the same modules, in the same order, on every "
                "rank (LayerDrop drawn from each rank's own generator, a branch on the rank's own data or an "
                "evaluation on one rank skip or add a ZeRO / FSDP unit's gathers); SHARDWISE_CHECK_COLLECTIVES=1 on "
                "gloo names the first call that differs")


class HyperparameterAgreement:
    """Step counts per optimizer and data-parallel group, and the check (module docstring). Counting per group keeps
    the checks of a group lined up when it is formed anew (elastic training re-wraps the model over the new
    membership while the survivors keep their optimizer)."""

    def __init__(self) -> None:
        self.steps: weakref.WeakKeyDictionary[torch.optim.Optimizer, dict[int, tuple[Communicator, int]]] = (
            weakref.WeakKeyDictionary())

    def check(self, optimizer: torch.optim.Optimizer, groups: list[Communicator],
              order_groups: Sequence[Communicator] = ()) -> None:
        """The checks due at this step of `optimizer`: hyperparameters and issued collectives over each of `groups`
        (the data-parallel groups), issued collectives only over each of `order_groups` (the groups the strategies
        reduce over besides: a hybrid-sharded model's shard and replica groups, a mesh's dp group)."""
        described = None
        for comm in groups:
            step = self._count(optimizer, comm)
            if step is None:
                continue
            if described is None:
                described = {"param_groups": [{key: _plain(value) for key, value in group.items() if key != "params"}
                                              for group in optimizer.param_groups]}
            with uncounted(comm):  # control traffic: comm.stats stays the strategy's own (comm/uncounted.py)
                _check_issued(comm, optimizer, step)
                check_agreement(comm, f"{type(optimizer).__name__}.step() (step {step})", described, advice=ADVICE)
        checked = {id(comm) for comm in groups}
        for comm in order_groups:
            step = None if id(comm) in checked else self._count(optimizer, comm)
            if step is not None:
                with uncounted(comm):
                    _check_issued(comm, optimizer, step)

    def _count(self, optimizer: torch.optim.Optimizer, comm: Communicator) -> int | None:
        """This step's number for `optimizer` over `comm` when a check is due at it (the first, every EVERY-th)."""
        counts = self.steps.setdefault(optimizer, {})
        step = counts.get(id(comm), (comm, 0))[1] + 1
        counts[id(comm)] = (comm, step)  # holding the group keeps its id from being reused by a later one
        return step if step == 1 or step % EVERY == 0 else None


def _check_issued(comm: Communicator, optimizer: torch.optim.Optimizer, step: int) -> None:
    """The running hash of the collectives each rank issued on `comm` agrees, where its calls are not checked one by
    one (module docstring); read before this check's own collective."""
    issued = getattr(comm, "issued_digest", lambda: None)()
    if issued is not None:
        check_agreement(comm, f"the collectives before {type(optimizer).__name__}.step() (step {step})",
                        {"collectives issued on this group (hash)": issued}, advice=ORDER_ADVICE)


def _plain(value: Any) -> Any:
    """A JSON-able form of a param-group entry: numbers, flags and strings as they are, a one-element tensor (a
    capturable or tensor learning rate) as its number, tuples as lists, anything else by its type's name."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__name__
