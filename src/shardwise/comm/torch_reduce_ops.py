"""Which torch.distributed reduction a shardwise ReduceOp is issued as, and how the shared-memory channel combines it.

gloo has no AVG reduction: AVG is issued as SUM and divided by the group size when the Work completes (NCCL has its
own AVG). The shared-memory channel (shm_channel.py) combines by name, AVG as a SUM divided the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .base import ReduceOp, check_reduce_op

__all__ = ["native_op", "combine_name"]

_NATIVE_OPS = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MAX: dist.ReduceOp.MAX, ReduceOp.MIN: dist.ReduceOp.MIN}


def native_op(op: ReduceOp, tensor: torch.Tensor, name: str, backend: str,
              size: int) -> tuple[dist.ReduceOp, Callable[[], None] | None]:
    """The torch op to issue for `op` on `tensor` (checked: ValueError naming `name`), and the finishing step (AVG
    as SUM, then a divide by the group `size`, on backends without AVG)."""
    op = check_reduce_op(name, op, tensor)
    if op is not ReduceOp.AVG:
        return _NATIVE_OPS[op], None
    if backend == "nccl":
        return dist.ReduceOp.AVG, None
    return dist.ReduceOp.SUM, lambda: tensor.div_(size)


def combine_name(op: ReduceOp) -> str:
    """How the shared-memory channel combines for `op` (AVG: a SUM, divided when the Work completes)."""
    return "SUM" if op is ReduceOp.AVG else op.name
