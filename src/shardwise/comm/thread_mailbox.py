"""Buffered point-to-point of the thread backend (its default mode; strict mode is strict_p2p.py).

A send copies its tensor into the mailbox of its (group, src, dst, tag) and returns at once; the n-th message sent
on a mailbox waits there for the n-th receive posted on it (matching in posting order, as MPI does), so a
receive's place in line is fixed when it is posted, not when it is waited for. A receive from any source takes
the earliest arrived message, among the next unclaimed one of each mailbox addressed to its rank.
"""

from __future__ import annotations

import torch

from .base import AnySourceWork, CommError, Work
from .thread_world import RankComm

__all__ = ["RecvWork", "AnyRecvWork"]


class RecvWork(Work):
    def __init__(self, comm: RankComm, tensor: torch.Tensor, src: int, tag: int) -> None:
        self.comm = comm
        self.tensor = tensor
        self.src = src
        self.key = (comm.group.id, src, comm.rank, tag)
        self.tag = tag
        self.done = False
        with comm.world.cond:  # the n-th receive posted on this pair gets the n-th message
            self.index = comm.world.claimed[self.key]
            comm.world.claimed[self.key] += 1

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout: float | None = None) -> None:
        if self.done:
            return
        comm = self.comm
        limit = comm.timeout if timeout is None else timeout
        box = comm.world.mailboxes

        def timed_out() -> CommError:
            src = comm.global_ranks[self.src]
            return CommError(
                f"recv(src={self.src}, tag={self.tag}) timed out after {limit:g}s on rank {comm.global_rank}"
                f"{comm.group_label()}: rank {src} never sent a matching message",
                op="recv",
                rank=comm.global_rank,
                peers=[src],
                waited=limit,
            )

        taken: list[torch.Tensor] = []

        def take() -> bool:  # runs under the world lock, so two receives never race for one message
            queue = box.get(self.key)
            if queue and self.index in queue:
                taken.append(queue.pop(self.index)[1])
            return bool(taken)

        comm.world.wait_until(take, limit, timed_out, f"recv(src={self.src}, tag={self.tag})")
        message = taken[0]
        if message.shape != self.tensor.shape or message.dtype != self.tensor.dtype:
            raise CommError(
                f"recv(src={self.src}, tag={self.tag}) on rank {comm.global_rank}: the message is "
                f"{tuple(message.shape)} {message.dtype} but the receive buffer is "
                f"{tuple(self.tensor.shape)} {self.tensor.dtype}",
                op="recv",
                rank=comm.global_rank,
                peers=[comm.global_ranks[self.src]],
            )
        with torch.no_grad():
            self.tensor.copy_(message)
        self.done = True


class AnyRecvWork(AnySourceWork):
    """A buffered receive from any source: takes the earliest arrived message to this rank (matching `tag`)."""

    def __init__(self, comm: RankComm, tensor: torch.Tensor, tag: int | None) -> None:
        self.comm, self.tensor, self.tag = comm, tensor, tag
        self.src: int | None = None

    def is_completed(self) -> bool:
        return self.src is not None

    def source(self, timeout: float | None = None) -> int:
        self.wait(timeout)
        return self.src

    def wait(self, timeout: float | None = None) -> None:
        if self.src is not None:
            return
        comm = self.comm
        limit = comm.timeout if timeout is None else timeout
        taken: list[tuple[int, torch.Tensor]] = []

        def take() -> bool:  # under the world lock
            world, best = comm.world, None
            for key, queue in world.mailboxes.items():  # the next unclaimed message of each pair to this rank
                group, _, dst, tag = key
                first = queue.get(world.claimed[key])
                if first is not None and group == comm.group.id and dst == comm.rank and self.tag in (None, tag):
                    if best is None or first[0] < best[1][0]:
                        best = (key, first)
            if best is not None:
                key = best[0]
                taken.append((key[1], world.mailboxes[key].pop(world.claimed[key])[1]))
                world.claimed[key] += 1
            return bool(taken)

        def timed_out() -> CommError:
            others = [g for g in comm.global_ranks if g != comm.global_rank]
            return CommError(f"recv_any(tag={self.tag}) timed out after {limit:g}s on rank {comm.global_rank}"
                             f"{comm.group_label()}: no rank sent a message", op="recv", rank=comm.global_rank,
                             peers=others, waited=limit)

        comm.world.wait_until(take, limit, timed_out, f"recv_any(tag={self.tag})")
        src, message = taken[0]
        if message.shape != self.tensor.shape or message.dtype != self.tensor.dtype:
            raise CommError(f"recv_any on rank {comm.global_rank}: the message from rank {comm.global_ranks[src]} is "
                            f"{tuple(message.shape)} {message.dtype} but the receive buffer is "
                            f"{tuple(self.tensor.shape)} {self.tensor.dtype}", op="recv", rank=comm.global_rank,
                            peers=[comm.global_ranks[src]])
        with torch.no_grad():
            self.tensor.copy_(message)
        self.src = src
