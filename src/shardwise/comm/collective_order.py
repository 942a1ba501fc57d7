"""Strict mode's argument and order checks: NCCL's rules that a buffered CPU backend would let pass.

* Every rank issues the collectives of one communicator in the same order, with the same arguments. The thread
  backend matches collectives by position (call #k of every rank is one operation); strict mode names, on a
  mismatch, the position, every rank's call there and the last calls each rank issued before it, so the diverging
  code path can be found (NCCL itself hangs or returns garbage).
* Every tensor handed to an operation lives on `comm.device` (NCCL only takes tensors on its own GPU; a CPU
  tensor reaching an NCCL collective is the commonest first failure of CPU-tested code on a GPU node).
"""

from __future__ import annotations

import collections

import torch

__all__ = ["History", "check_device", "mismatch_message"]

_KEPT = 3  # calls of history shown per rank


class History:
    """The last few collectives each rank issued on one group (strict mode keeps it for the mismatch message)."""

    def __init__(self) -> None:
        self._calls: dict[int, collections.deque[str]] = {}

    def add(self, rank: int, seq: int, call: str) -> None:
        self._calls.setdefault(rank, collections.deque(maxlen=_KEPT + 1)).append(f"#{seq} {call}")

    def before(self, rank: int) -> list[str]:
        """The calls of `rank` before its latest one (at most a few)."""
        return list(self._calls.get(rank, ()))[:-1]


def mismatch_message(seq: int, group: str, calls: dict[int, str], history: History,
                     world_rank: dict[int, int]) -> str:
    """What a CommError says when ranks issued different collectives as call #seq of one communicator."""
    issued = "; ".join(f"rank {world_rank[r]} issued {call}" for r, call in sorted(calls.items()))
    earlier = "; ".join(f"rank {world_rank[r]}: {', '.join(history.before(r)) or 'nothing'}" for r in sorted(calls))
    return (f"mismatched collectives at call #{seq}{group}: {issued} (every rank must issue the "
            f"collectives of a communicator in the same order, NCCL's rule; calls before it: {earlier})")


def check_device(op: str, what: str, tensor: torch.Tensor, device: torch.device) -> None:
    """Raise ValueError unless `tensor` is on `device` (compared by type and index; CPU has no index)."""
    have = tensor.device
    if have.type != device.type or (device.index is not None and have.index not in (None, device.index)):
        raise ValueError(
            f"{op}: {what} is on {have} but this communicator's device is {device}; strict mode enforces NCCL's rule "
            f"that every tensor of an operation lives on comm.device (allocate it with device=comm.device or move it "
            f"with .to(comm.device))")
