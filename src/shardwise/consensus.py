"""`agree(flag, comm, how)`: one decision that every rank takes together (early stopping, skipping a step, saving).

Why: a rank that leaves the training loop while its peers go on leaves them waiting in the next collective until
the timeout; ranks that decide from local numbers (their own validation shard, a local NaN check, a wall-clock
budget read on each host) can disagree even when the rule is the same. The design documents' ShouldEarlyStop()
is "consensus across ranks"; Horovod answers it with a broadcast from rank 0 (`hvd.broadcast_object`), DeepSpeed
and Lightning with an all-reduce of a flag (`Strategy.reduce_boolean_decision`, `all=True` by default).

Mechanism: each rank contributes its flag as one int32 (0 or 1) and a single 4-byte all-reduce combines them, MAX
for how="any" (stop when any rank wants to) and MIN for how="all" (stop only when every rank does). Every rank
returns the same bool, so the ranks leave the loop at the same step. Collective: every rank of `comm` must call
it, in the same order as its other collectives; a group of one answers without communicating.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

from .comm.base import Communicator, ReduceOp, is_communicator

__all__ = ["agree", "HOW"]

#: The allowed values of `how`, and the reduction that realises each.
HOW = {"any": ReduceOp.MAX, "all": ReduceOp.MIN}


def _as_bool(flag: Any) -> bool:
    """`flag` as a bool: a bool (Python or NumPy), 0 or 1, or a one-element tensor of those; else ValueError."""
    if isinstance(flag, torch.Tensor):
        if flag.numel() != 1 or flag.is_floating_point() or flag.is_complex():
            raise ValueError(f"agree: flag must be a bool; got a tensor of shape {tuple(flag.shape)} and dtype "
                             f"{flag.dtype} (allowed: a one-element bool or integer tensor holding 0 or 1)")
        flag = flag.item()
    if isinstance(flag, bool) or (type(flag).__module__ == "numpy" and type(flag).__name__ in ("bool", "bool_")):
        return bool(flag)
    if isinstance(flag, numbers.Integral) and int(flag) in (0, 1):
        return bool(flag)
    raise ValueError(f"agree: flag={flag!r} is not a bool; allowed: True/False, 0/1 or a one-element tensor of them")


def agree(flag: Any, comm: Communicator, how: str = "any") -> bool:
    """True when `how` of the ranks of `comm` passed a true `flag`: "any" (at least one) or "all" (every rank).

    flag: this rank's vote: a bool, 0/1, or a one-element bool/integer tensor. comm: the group that must decide
    together (usually the world, or `mesh.dp` when only data-parallel replicas vote). Returns the same bool on
    every rank; raises ValueError for a `how` outside HOW, a flag that is not a bool, or a `comm` that is not a
    Communicator, and CommError if a peer does not join within the communicator's timeout.
    """
    if how not in HOW:
        raise ValueError(f"agree: how={how!r} is not supported; allowed: {sorted(HOW)}")
    if not is_communicator(comm):
        raise ValueError(f"agree: comm must be a shardwise Communicator (sw.init(), sw.launch's argument, a mesh "
                         f"axis); got {type(comm).__name__}")
    vote = _as_bool(flag)
    if comm.size == 1:
        return vote
    ballot = torch.tensor([int(vote)], dtype=torch.int32, device=comm.device)
    comm.all_reduce(ballot, HOW[how])
    return bool(ballot.item())
