"""Parameters no rank used in a step keep `grad = None`, as in one process.

In one process a parameter that took no part in the loss (an expert that got no token, a branch not taken) keeps
`.grad = None`, and every torch optimizer skips it: no weight decay, no momentum step. A strategy that sums or
averages gradients over ranks must not turn "no gradient anywhere" into a zero gradient, which AdamW would act on.
Where the gradients travel in one flat reduction the flags ride along (sharding/grad_layout.py); this module is the
separate small agreement for parameters reduced one by one (weights tied across pipeline ranks, parameters a
sharding engine keeps replicated): one all-reduce of a flag per parameter over each group, the same order on every
rank. DDP does the same with `find_unused_parameters=True` (ddp.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .comm.base import Communicator, ReduceOp

__all__ = ["used_anywhere"]


def used_anywhere(used_here: Sequence[bool], groups: Sequence[Communicator | None],
                  device: torch.device | str) -> list[bool]:
    """Which of the parameters (this rank's flags, `used_here`) some rank of all `groups` together used. Collective
    over each group of more than one rank, in order (their product spans the ranks to agree over)."""
    flags = torch.tensor([1 if u else 0 for u in used_here], dtype=torch.int32)  # counts of users
    flags = flags.to(device, non_blocking=True)  # from pageable memory: staged, the host does not wait for the GPU
    for group in groups:
        if group is not None and group.size > 1 and flags.numel():
            group.all_reduce(flags, ReduceOp.SUM)
    # Used here means used somewhere: the host reads the counts (waiting for the GPU) only when it must.
    return list(map(bool, used_here)) if all(used_here) else (flags > 0).tolist()
