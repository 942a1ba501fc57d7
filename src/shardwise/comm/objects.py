"""Collectives of small JSON-serialisable objects (metadata, piece lists), over any Communicator.

Objects travel as UTF-8 JSON in uint8 tensors, never as pickles: what a peer sends cannot execute code here. Two
rounds: the byte lengths, then the payloads padded to the longest. On GPU backends the tensors go through the
communicator's device when it has one.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from .base import Communicator, ReduceOp

__all__ = ["all_gather_json", "broadcast_json"]


def _device(comm: Communicator) -> torch.device:
    return getattr(comm, "device", torch.device("cpu"))


def all_gather_json(comm: Communicator, obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank."""
    device = _device(comm)
    payload = json.dumps(obj, separators=(",", ":")).encode()
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    lengths = torch.empty(comm.size, dtype=torch.int64, device=device)
    comm.all_gather(lengths, length)
    longest = int(lengths.max().item())
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else mine[:0]
    everyone = torch.empty(longest * comm.size, dtype=torch.uint8, device=device)
    comm.all_gather(everyone, mine)
    data = everyone.cpu().numpy().tobytes()
    return [json.loads(data[r * longest : r * longest + int(n)]) for r, n in enumerate(lengths.tolist())]


def broadcast_json(comm: Communicator, obj: Any, src: int = 0) -> Any:
    """Rank `src`'s `obj` on every rank (other ranks' `obj` is ignored)."""
    device = _device(comm)
    payload = json.dumps(obj, separators=(",", ":")).encode() if comm.rank == src else b""
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    comm.all_reduce(length, ReduceOp.MAX)  # only src's is non-zero
    buffer = torch.zeros(int(length.item()), dtype=torch.uint8, device=device)
    if comm.rank == src and payload:
        buffer.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    comm.broadcast(buffer, src)
    return json.loads(buffer.cpu().numpy().tobytes())
