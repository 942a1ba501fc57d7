"""Communicator operations on the thread backend (1-4 ranks) and on gloo processes (2 ranks)."""

from __future__ import annotations

import time

import pytest
import torch
from comm_checks import check_collectives, check_point_to_point, check_split, skip_one_collective

import shardwise as sw
from shardwise.comm import CommError, CommStats, ReduceOp, ThreadWorld, wire_bytes
from shardwise.comm.base import P2POp


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_collectives_match_reference(size):
    stats = sw.launch(check_collectives, size)
    assert stats[0]["all_reduce"]["calls"] == 2 * len(ReduceOp)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_point_to_point(size):
    sw.launch(check_point_to_point, size)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_split_into_sub_communicators(size):
    results = sw.launch(check_split, size)
    assert [s for s, _ in results] == [len([r for r in range(size) if r % 2 == q % 2]) for q in range(size)]


def test_results_are_deterministic_whatever_the_thread_timing():
    def body(comm):
        torch.manual_seed(0)  # the same values on every run, different per rank below
        t = torch.randn(1000, generator=torch.Generator().manual_seed(comm.rank)) * 1e3
        if comm.rank == 1:
            time.sleep(0.01)  # change the arrival order
        comm.all_reduce(t)
        return t

    first = sw.launch(body, 4)
    again = sw.launch(body, 4)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


def test_async_collective_overlaps_with_compute():
    """An async all_reduce returns before the slow rank arrives; the fast rank computes meanwhile."""

    def body(comm):
        t = torch.ones(4)
        if comm.rank == 1:
            time.sleep(0.2)
        work = comm.all_reduce(t, async_op=True)
        completed_at_issue = work.is_completed()
        work.wait()
        return completed_at_issue, t.sum().item()

    (early0, total0), (_, total1) = sw.launch(body, 2)
    assert early0 is False  # rank 0 was not blocked by the call itself
    assert total0 == total1 == 8.0


def test_rank_that_never_joins_raises_comm_error_within_timeout():
    start = time.monotonic()
    with pytest.raises(sw.LaunchError) as info:
        sw.launch(skip_one_collective, 3, timeout=0.5)
    elapsed = time.monotonic() - start
    assert elapsed < 5
    message = str(info.value)
    assert "CommError" in message and "all_reduce" in message
    assert "[2]" in message and "never called it" in message  # names the missing rank


def test_recv_without_sender_times_out_naming_the_peer():
    def body(comm):
        if comm.rank == 0:
            comm.recv(torch.empty(1), src=1)

    with pytest.raises(sw.LaunchError, match=r"recv.*rank 1 never sent"):
        sw.launch(body, 2, timeout=0.3)


def test_mismatched_collectives_are_reported_not_hung():
    def body(comm):
        if comm.rank == 0:
            comm.all_reduce(torch.ones(2))
        else:
            comm.broadcast(torch.ones(2), src=0)

    with pytest.raises(sw.LaunchError, match="mismatched collectives"):
        sw.launch(body, 2, timeout=5)


def test_failure_on_one_rank_stops_the_others_and_names_it():
    def body(comm):
        if comm.rank == 2:
            raise ValueError("boom on purpose")
        comm.all_reduce(torch.ones(1))  # would wait for rank 2 until the timeout without the abort

    start = time.monotonic()
    with pytest.raises(sw.LaunchError) as info:
        sw.launch(body, 3, timeout=30)
    assert time.monotonic() - start < 5
    assert info.value.rank == 2
    assert "boom on purpose" in str(info.value) and "ValueError" in info.value.remote_traceback


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda c: c.all_reduce(torch.ones(2, dtype=torch.int64), ReduceOp.AVG), "AVG needs a floating-point"),
        (lambda c: c.all_reduce(torch.ones(2), "sum"), "is not a ReduceOp"),
        (lambda c: c.all_gather(torch.empty(3), torch.ones(2)), "must have size x chunk"),
        (lambda c: c.reduce_scatter(torch.empty(2), torch.ones(3)), "must have size x chunk"),
        (lambda c: c.broadcast(torch.ones(1), src=5), "src=5 is not a rank"),
        (lambda c: c.isend(torch.ones(1), dst=-1), "dst=-1 is not a rank"),
        (lambda c: c.split(-3), "color=-3"),
    ],
)
def test_bad_arguments_raise_value_error_early(call, match):
    comm = ThreadWorld(2).communicators()[0]
    with pytest.raises(ValueError, match=match):
        call(comm)


def test_comm_stats_counts_payload_and_ring_wire_bytes():
    def body(comm):
        with comm.stats.measure() as step:
            comm.all_reduce(torch.ones(100))  # 400 bytes
            comm.all_gather(torch.empty(10 * comm.size), torch.ones(10))  # 40 x size bytes gathered
            comm.reduce_scatter(torch.empty(10), torch.ones(10 * comm.size))
        comm.broadcast(torch.ones(1))  # outside the measured block
        return step.as_dict(), comm.stats.calls()

    n = 4
    step, total_calls = sw.launch(body, n)[0]
    assert step["all_reduce"] == {"calls": 1, "bytes": 400, "wire_bytes": 2 * (n - 1) * 400 // n}
    assert step["all_gather"] == {"calls": 1, "bytes": 40 * n, "wire_bytes": (n - 1) * 40}
    assert step["reduce_scatter"] == {"calls": 1, "bytes": 40 * n, "wire_bytes": (n - 1) * 40}
    assert "broadcast" not in step and total_calls == 4


def test_comm_stats_helpers():
    stats = CommStats()
    stats.record("all_reduce", 1000, 4)
    snap = stats.snapshot()
    stats.record("send", 10, 4)
    assert stats.since(snap).as_dict() == {"send": {"calls": 1, "bytes": 10, "wire_bytes": 10}}
    assert stats.merge(snap).calls("all_reduce") == 2
    assert wire_bytes("all_reduce", 1000, 1) == 0
    stats.reset()
    assert stats.calls() == 0


def test_abort_wakes_waiters():
    world = ThreadWorld(2, timeout=30)
    comm = world.communicators()[0]
    work = comm.all_reduce(torch.ones(1), async_op=True)
    world.abort("test abort")
    with pytest.raises(CommError, match="test abort"):
        work.wait()


# ---- gloo processes ---------------------------------------------------------------------------------------------------
def _gloo_everything(comm):
    stats = check_collectives(comm)
    check_point_to_point(comm)
    check_split(comm)
    return stats


@pytest.mark.multiprocess
def test_gloo_two_ranks_pass_the_same_checks():
    stats = sw.launch(_gloo_everything, 2, backend="gloo", timeout=30)
    assert stats[0]["all_reduce"]["calls"] == 2 * len(ReduceOp)


@pytest.mark.multiprocess
def test_gloo_rank_that_never_joins_raises_comm_error():
    start = time.monotonic()
    with pytest.raises(sw.LaunchError) as info:
        sw.launch(skip_one_collective, 2, backend="gloo", timeout=3)
    assert time.monotonic() - start < 30
    assert info.value.rank == 0 and "CommError" in str(info.value)


def _parameter_server(comm):
    """Rank 0 serves whichever worker pushes first (recv_any), answering each; workers push in reverse rank order."""
    if comm.rank == 0:
        seen = []
        for _ in range(comm.size - 1):
            buf = torch.empty(2)
            src = comm.recv_any(buf)
            assert buf.tolist() == [float(src)] * 2
            seen.append(src)
            comm.send(buf * 10, src)
        return seen
    time.sleep(0.3 * (comm.size - comm.rank))
    comm.send(torch.full((2,), float(comm.rank)), 0)
    reply = torch.empty(2)
    comm.recv(reply, 0)
    return reply.tolist()


@pytest.mark.multiprocess
def test_gloo_recv_any_takes_messages_in_arrival_order():
    out = sw.launch(_parameter_server, 3, backend="gloo", timeout=30)
    assert out[0] == [2, 1] and out[1] == [10.0, 10.0] and out[2] == [20.0, 20.0]


def test_thread_recv_any_and_batch_isend_irecv_validate_their_arguments():
    comm = ThreadWorld(2).communicators()[0]
    with pytest.raises(ValueError, match=r"batch_isend_irecv: ops=.* must be a list of P2POp"):
        comm.batch_isend_irecv([("send", torch.ones(1), 1)])
    with pytest.raises(ValueError, match=r"batch_isend_irecv: peer=5 is not a rank of this group; allowed 0..1"):
        comm.batch_isend_irecv([P2POp.send(torch.ones(1), 5)])
    with pytest.raises(ValueError, match=r"recv_any: tag='x' must be an int or None"):
        comm.irecv_any(torch.ones(1), tag="x")
    assert comm.batch_isend_irecv([]) == []


# On MPI the same parameter server runs inside tests/test_mpi.py's one launch per world size (an mpirun costs seconds).
