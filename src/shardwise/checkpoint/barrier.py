"""The checkpoint's I/O barrier: a barrier whose deadline is the checkpoint's I/O timeout, not the communicator's.

Saving ends with every rank waiting for rank 0 to merge the indexes and rename the directory into place; exporting a
full state dict, for rank 0 to write one large file. On a parallel file system (Lustre, GPFS) under load a large
shard can take minutes, far beyond a collective timeout sized for a training step (60 s), so the ranks that wait
would raise CommError while nothing is wrong. The barrier is a one-element all-reduce on `comm.device` (NCCL has no
CPU tensors) whose wait blocks the host with its own timeout.
"""

from __future__ import annotations

import torch

from ..comm.base import Communicator
from ..placement import comm_device

__all__ = ["DEFAULT_IO_TIMEOUT", "io_barrier"]

DEFAULT_IO_TIMEOUT = 600.0  # seconds: writing and renaming large shards on a busy parallel file system


def io_barrier(comm: Communicator, timeout: float) -> None:
    """Block until every rank of `comm` arrived, or raise CommError after `timeout` seconds. Collective."""
    if not timeout > 0:
        raise ValueError(f"checkpoint: timeout={timeout!r} must be a positive number of seconds")
    if comm.size == 1:
        return
    flag = torch.zeros(1, device=comm_device(comm))
    work = comm.all_reduce(flag, async_op=True)
    work.wait(timeout)  # an explicit timeout: the host waits (see comm/streams.py), as a barrier must
