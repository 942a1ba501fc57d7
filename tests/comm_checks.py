"""Rank bodies that exercise every Communicator operation against values computed from the rank numbers.

Shared by the thread-backend tests (1-4 ranks) and the gloo-process tests, so both backends pass the very same
checks. Each body raises AssertionError on the failing rank; `launch` turns that into a LaunchError naming it.
"""

from __future__ import annotations

import torch

from shardwise.comm import ReduceOp


def _value(rank: int, n: int = 6) -> torch.Tensor:
    """Rank-specific data whose reductions are easy to compute independently."""
    return torch.arange(n, dtype=torch.float32) * (rank + 1) + rank


def _expected_reduce(size: int, op: ReduceOp, n: int = 6) -> torch.Tensor:
    stacked = torch.stack([_value(r, n) for r in range(size)])
    return {
        ReduceOp.SUM: stacked.sum(0),
        ReduceOp.AVG: stacked.sum(0) / size,
        ReduceOp.MAX: stacked.max(0).values,
        ReduceOp.MIN: stacked.min(0).values,
    }[op]


def check_collectives(comm) -> dict:
    """all_reduce (4 ops, sync and async), all_gather, reduce_scatter, broadcast from every root, barrier."""
    rank, size = comm.rank, comm.size
    for op in ReduceOp:
        t = _value(rank)
        comm.all_reduce(t, op)
        torch.testing.assert_close(t, _expected_reduce(size, op), rtol=1e-6, atol=1e-6)
        t = _value(rank)
        work = comm.all_reduce(t, op, async_op=True)
        work.wait()
        assert work.is_completed()
        torch.testing.assert_close(t, _expected_reduce(size, op), rtol=1e-6, atol=1e-6)

    out = torch.empty(3 * size)
    comm.all_gather(out, _value(rank, 3))
    torch.testing.assert_close(out, torch.cat([_value(r, 3) for r in range(size)]))
    out2 = torch.empty(size, 3)  # a 2-D output is filled as one flat buffer
    comm.all_gather(out2, _value(rank, 3), async_op=True).wait()
    torch.testing.assert_close(out2.view(-1), out.view(-1))

    full = _value(rank, 4 * size)
    for op in (ReduceOp.SUM, ReduceOp.AVG):
        chunk = torch.empty(4)
        comm.reduce_scatter(chunk, full, op, async_op=True).wait()
        expected = _expected_reduce(size, op, 4 * size)[rank * 4 : (rank + 1) * 4]
        torch.testing.assert_close(chunk, expected, rtol=1e-6, atol=1e-6)

    for src in range(size):
        b = _value(rank, 5)
        comm.broadcast(b, src=src)
        torch.testing.assert_close(b, _value(src, 5))

    comm.barrier()
    return comm.stats.as_dict()


def check_point_to_point(comm) -> None:
    """A ring exchange posted as one batch_isend_irecv (separate isend/irecv deadlock under NCCL's unbuffered,
    in-order point-to-point, which strict mode models) and blocking send/recv pairs."""
    from shardwise.comm.base import P2POp

    rank, size = comm.rank, comm.size
    if size == 1:
        return
    right, left = (rank + 1) % size, (rank - 1) % size
    got = torch.empty(4)
    works = comm.batch_isend_irecv([P2POp.send(_value(rank, 4), right), P2POp.recv(got, left)])
    assert len(works) == 2
    for work in works:
        work.wait()
    torch.testing.assert_close(got, _value(left, 4))
    # Blocking pairs between 0 and 1: 0 sends then receives, 1 receives then sends.
    if rank in (0, 1):
        peer = 1 - rank
        buf = torch.empty(2, 3)
        if rank == 0:
            comm.send(torch.ones(2, 3) * 7, peer)
            comm.recv(buf, peer)
            torch.testing.assert_close(buf, torch.ones(2, 3) * 8)
        else:
            comm.recv(buf, peer)
            torch.testing.assert_close(buf, torch.ones(2, 3) * 7)
            comm.send(torch.ones(2, 3) * 8, peer)


def check_split(comm) -> tuple[int, int]:
    """Split by parity, reversed key order inside each group; collectives on the sub-group see only its members."""
    rank, size = comm.rank, comm.size
    sub = comm.split(rank % 2, key=-rank)
    members = [r for r in range(size) if r % 2 == rank % 2]
    assert sub.size == len(members)
    assert list(sub.global_ranks) == sorted(members, reverse=True), sub.global_ranks
    assert sub.rank == sorted(members, reverse=True).index(rank)
    t = torch.tensor([float(rank)])
    sub.all_reduce(t)
    assert t.item() == float(sum(members))
    # A rank passing color=None joins no group.
    none_or_sub = comm.split(None if rank == 0 else 1)
    assert (none_or_sub is None) == (rank == 0)
    if none_or_sub is not None:
        t = torch.ones(1)
        none_or_sub.all_reduce(t)
        assert t.item() == size - 1
    # Nested: split a sub-communicator again.
    nested = sub.split(0)
    nested.barrier()
    t = torch.ones(1)
    nested.all_reduce(t)
    assert t.item() == len(members)
    return sub.size, sub.rank


def skip_one_collective(comm) -> None:
    """The last rank never calls the all_reduce: the others must raise CommError naming it, within the timeout."""
    if comm.rank == comm.size - 1:
        return None
    comm.all_reduce(torch.ones(1))
