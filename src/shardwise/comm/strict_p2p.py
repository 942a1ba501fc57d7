"""Strict mode's point-to-point: unbuffered, untagged, matched in posting order per pair of ranks (NCCL's rules).

A send is never copied into a buffer: it stays *pending* until the matching receive is posted and both sides'
batches have started on their streams (`strict_stream.py`); then the receiver's tensor is filled from the sender's
tensor as it is at that moment (so a sender that modifies its tensor before the send completes is caught by
wrong values, as on NCCL). Tags are ignored: the n-th send from a to b meets the n-th receive of b from a.

Receive-from-any-source (`irecv_any`) is the explicit exception, for protocols with unordered arrivals (a
parameter server): once its batch has started it takes the earliest posted unmatched send to its rank whose
batch has started too (a tag, when given, must equal the send's).

A `Batch` is the sends and receives one rank posted together: strict_stream.py queues it on the rank's stream.
"""

from __future__ import annotations

import collections
import itertools
import torch

from .thread_world import RankComm

__all__ = ["P2PEntry", "Pairing", "Batch", "transfer"]


class P2PEntry:
    """One send or receive of a strict batch. `peer` is a rank of the group (None: a receive from any source)."""

    def __init__(self, send: bool, tensor: torch.Tensor, peer: int | None, tag: int | None, rank: int,
                 order: int) -> None:
        self.send, self.tensor, self.peer, self.tag, self.rank, self.order = send, tensor, peer, tag, rank, order
        self.batch: Batch | None = None
        self.partner: P2PEntry | None = None
        self.done = False
        self.error: str | None = None

    @property
    def source(self) -> int | None:
        """For a receive: the group rank the message came from (None until matched)."""
        return None if self.partner is None else self.partner.rank

    def describe(self) -> str:
        if self.send:
            return f"send(dst={self.peer}, numel={self.tensor.numel()})"
        return f"recv(src={'any' if self.peer is None else self.peer}, numel={self.tensor.numel()})"


class Batch:
    """Sends and receives posted together on a rank's stream (one entry for a plain isend / irecv)."""

    def __init__(self, comm: RankComm, entries: list[P2PEntry]) -> None:
        self.comm, self.entries = comm, entries
        self.started = self.done = False
        self.error: str | None = None
        for e in entries:
            e.batch = self
        self.label = "batch " + ", ".join(e.describe() for e in entries) if len(entries) > 1 else entries[0].describe()


class Pairing:
    """The unmatched sends and receives of one group, matched in posting order per (src, dst) pair."""

    def __init__(self) -> None:
        self._order = itertools.count()
        self.sends: dict[tuple[int, int], collections.deque[P2PEntry]] = {}
        self.recvs: dict[tuple[int, int], collections.deque[P2PEntry]] = {}
        self.any_recvs: dict[int, list[P2PEntry]] = {}  # dst -> receives from any source, not matched yet

    def entry(self, send: bool, tensor: torch.Tensor, peer: int | None, tag: int | None, rank: int) -> P2PEntry:
        return P2PEntry(send, tensor, peer, tag, rank, next(self._order))

    def post(self, e: P2PEntry) -> None:
        """Match `e` with the oldest waiting partner of its pair, or queue it."""
        if e.send:
            queue = self.recvs.get((e.rank, e.peer))
            if queue:
                _pair(e, queue.popleft())
            else:
                self.sends.setdefault((e.rank, e.peer), collections.deque()).append(e)
        elif e.peer is None:
            self.any_recvs.setdefault(e.rank, []).append(e)
        else:
            queue = self.sends.get((e.peer, e.rank))
            if queue:
                _pair(queue.popleft(), e)
            else:
                self.recvs.setdefault((e.peer, e.rank), collections.deque()).append(e)

    def match_any(self, e: P2PEntry) -> bool:
        """For a started receive-from-any `e`: take the earliest posted unmatched send to its rank whose batch has
        started (and whose tag matches, if `e` has one). True if matched."""
        candidates = [q[0] for (src, dst), q in self.sends.items() if dst == e.rank and q and q[0].batch.started
                      and (e.tag is None or q[0].tag == e.tag)]
        if not candidates:
            return False
        send = min(candidates, key=lambda c: c.order)
        self.sends[(send.rank, e.rank)].popleft()
        self.any_recvs[e.rank].remove(e)
        _pair(send, e)
        return True


def _pair(send: P2PEntry, recv: P2PEntry) -> None:
    send.partner, recv.partner = recv, send


def transfer(send: P2PEntry, recv: P2PEntry, label: str) -> None:
    """Deliver `send` into `recv` (both batches have started); a shape or dtype mismatch is an error on both."""
    src, dst = send.tensor, recv.tensor
    if src.shape != dst.shape or src.dtype != dst.dtype:
        send.error = recv.error = (
            f"point-to-point message from rank {send.rank} to rank {recv.rank}{label} is {tuple(src.shape)} "
            f"{src.dtype} but the receive buffer is {tuple(dst.shape)} {dst.dtype}: messages between two ranks "
            f"match in posting order, without tags (strict mode, as NCCL), so the two sides posted different "
            f"sequences")
    else:
        with torch.no_grad():
            dst.copy_(src)
    send.done = recv.done = True
