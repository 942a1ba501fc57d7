"""Strict mode of the thread backend: NCCL's rules on CPU (comm/strict_stream.py), and receive-from-any-source.

Each test builds the faulty pattern directly and checks that strict mode reports it as a CommError (or a
ValueError for a bad argument) naming what was wrong, quickly, instead of passing (buffered backend) or hanging
(NCCL).
"""

from __future__ import annotations

import time

import pytest
import torch

import shardwise as sw
from shardwise.comm.base import CommError, P2POp
from shardwise.comm.strict_stream import strict_default
from shardwise.comm.thread_backend import ThreadWorld


def _run(world: ThreadWorld, body) -> list:
    """Run body(comm) on every rank of `world` in threads; return per rank its result or the exception it raised."""
    import threading

    comms = world.communicators()
    out: list = [None] * world.size

    def main(r: int) -> None:
        try:
            out[r] = body(comms[r])
        except Exception as exc:  # collected and checked by the test
            out[r] = exc
            world.abort(f"rank {r} raised {exc!r}", r)

    threads = [threading.Thread(target=main, args=(r,)) for r in range(world.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return out


def test_the_suite_runs_strict_by_default_and_the_switch_is_validated(monkeypatch):
    assert strict_default() and ThreadWorld(2).strict is not None  # tests/conftest.py sets SHARDWISE_STRICT=1
    assert ThreadWorld(2, strict=False).strict is None
    monkeypatch.setenv("SHARDWISE_STRICT", "maybe")
    with pytest.raises(ValueError, match=r"SHARDWISE_STRICT='maybe' is not a boolean"):
        ThreadWorld(2)
    with pytest.raises(ValueError, match=r"strict='yes' must be True, False or None"):
        ThreadWorld(2, strict="yes")


def test_the_1f1b_pattern_of_separate_receives_posted_first_is_a_deadlock_reported_at_once():
    # The pattern, as the old executor posted it: rank 0 recv(grad) then send(act); rank 1 recv(act) then
    # send(grad), each an independent isend/irecv on the one stream of the pair. Buffered sends hide it.
    def unpaired(comm):
        act, grad = torch.ones(4), torch.empty(4)
        if comm.rank == 0:
            works = [comm.irecv(grad, 1), comm.isend(act, 1)]
        else:
            works = [comm.irecv(torch.empty(4), 0), comm.isend(torch.full((4,), 2.0), 0)]
        for w in works:
            w.wait()
        return True

    start = time.monotonic()
    out = _run(ThreadWorld(2, timeout=60, strict=True), unpaired)
    assert time.monotonic() - start < 5  # found as a deadlock, not after the 60 s timeout
    assert all(isinstance(e, CommError) for e in out), out
    message = " ".join(str(e) for e in out)
    assert "deadlock, every rank waits and none can go on (strict mode)" in message
    assert "rank 0 waits in recv(src=1, numel=4)" in message and "rank 1 waits in recv(src=0, numel=4)" in message
    assert "stream is stuck at" in message
    assert _run(ThreadWorld(2, timeout=60, strict=False), unpaired) == [True, True]  # buffered: no error

    def paired(comm):  # the fix: the step's send and receive posted together
        peer, got = 1 - comm.rank, torch.empty(4)
        for w in comm.batch_isend_irecv([P2POp.recv(got, peer), P2POp.send(torch.full((4,), comm.rank + 1.0), peer)]):
            w.wait()
        return got.tolist()

    assert _run(ThreadWorld(2, timeout=5, strict=True), paired) == [[2.0] * 4, [1.0] * 4]


def test_point_to_point_is_untagged_and_matched_in_posting_order():
    def body(comm):
        if comm.rank == 0:
            comm.batch_isend_irecv([P2POp.send(torch.full((2,), 1.0), 1, tag=7), P2POp.send(torch.full((2,), 2.0), 1, tag=9)])
            return None
        a, b = torch.empty(2), torch.empty(2)
        works = comm.batch_isend_irecv([P2POp.recv(a, 0, tag=9), P2POp.recv(b, 0, tag=7)])  # tags ignored
        for w in works:
            w.wait()
        return a[0].item(), b[0].item()

    assert _run(ThreadWorld(2, timeout=5, strict=True), body)[1] == (1.0, 2.0)
    assert _run(ThreadWorld(2, timeout=5, strict=False), body)[1] == (2.0, 1.0)  # buffered honours tags


def test_a_send_is_unbuffered_it_completes_only_when_the_receive_runs():
    def body(comm):
        if comm.rank == 0:
            t = torch.ones(3)
            work = comm.isend(t, 1)
            time.sleep(0.2)
            pending = not work.is_completed()
            t.fill_(5.0)  # NCCL reads the buffer when the transfer runs: a bug to modify it, seen as wrong values
            work.wait()
            return pending
        time.sleep(0.6)
        got = torch.empty(3)
        comm.recv(got, 0)
        return got.tolist()

    pending, got = _run(ThreadWorld(2, timeout=5, strict=True), body)
    assert pending is True and got == [5.0] * 3


def test_a_collective_queued_behind_an_unmatched_send_is_a_deadlock():
    # One stream per rank and communicator: rank 0's barrier cannot start before its send finished, and rank 1
    # receives only after the barrier. Fine with buffered sends; a hang on NCCL.
    def body(comm):
        if comm.rank == 0:
            comm.isend(torch.ones(3), 1)
            comm.barrier()
        else:
            comm.barrier()
            comm.recv(torch.empty(3), 0)
        return True

    out = _run(ThreadWorld(2, timeout=30, strict=True), body)
    assert all(isinstance(e, CommError) for e in out)
    assert "rank 1 waits in barrier(): rank 0 issued it but its stream is stuck at send(dst=1, numel=3)" in str(out)
    assert _run(ThreadWorld(2, timeout=5, strict=False), body) == [True, True]


def test_collectives_issued_in_different_orders_are_named():
    def body(comm):
        comm.all_reduce(torch.ones(2))
        if comm.rank == 0:
            comm.all_reduce(torch.ones(3))
            comm.broadcast(torch.ones(5), src=0)
        else:
            comm.broadcast(torch.ones(5), src=0)
            comm.all_reduce(torch.ones(3))

    out = _run(ThreadWorld(2, timeout=5, strict=True), body)
    assert all(isinstance(e, CommError) for e in out)
    message = str(out[0])
    assert "mismatched collectives at call #1: rank 0 issued all_reduce(op=SUM, numel=3" in message
    assert "rank 1 issued broadcast(src=0, numel=5" in message
    assert "calls before it: rank 0: #0 all_reduce(op=SUM, numel=2" in message


def test_a_tensor_off_the_communicators_device_raises_naming_both():
    def body(comm):
        with pytest.raises(ValueError, match=r"all_reduce: the tensor is on meta but this communicator's device is "
                                             r"cpu"):
            comm.all_reduce(torch.ones(2, device="meta"))
        with pytest.raises(ValueError, match=r"batch_isend_irecv: the tensor is on meta"):
            comm.batch_isend_irecv([P2POp.send(torch.ones(2, device="meta"), 1 - comm.rank)])
        return True

    assert _run(ThreadWorld(2, timeout=5, strict=True), body) == [True, True]
    meta_world = ThreadWorld(1, strict=True, device="meta")
    with pytest.raises(ValueError, match=r"broadcast: the tensor is on cpu but this communicator's device is meta"):
        meta_world.communicators()[0].broadcast(torch.ones(1))


@pytest.mark.parametrize("strict", [True, False])
def test_recv_any_serves_a_parameter_server_in_arrival_order(strict):
    # Workers push at different times; the server takes whoever comes first and answers that worker.
    def body(comm):
        if comm.rank == 0:
            seen = []
            for _ in range(comm.size - 1):
                buf = torch.empty(1)
                src = comm.recv_any(buf)
                assert buf.item() == float(src)
                seen.append(src)
                comm.send(buf * 10, src)
            return seen
        time.sleep(0.15 * (comm.size - comm.rank))  # rank 3 first, then 2, then 1
        comm.send(torch.full((1,), float(comm.rank)), 0)
        reply = torch.empty(1)
        comm.recv(reply, 0)
        return reply.item()

    out = _run(ThreadWorld(4, timeout=10, strict=strict), body)
    assert out[0] == [3, 2, 1] and out[1:] == [10.0, 20.0, 30.0]


def test_recv_any_without_a_sender_times_out_naming_the_operation():
    def body(comm):
        if comm.rank == 0:
            comm.irecv_any(torch.empty(1), tag=None).wait(timeout=0.3)
        else:
            time.sleep(1.0)  # alive but silent: no deadlock, a timeout

    out = _run(ThreadWorld(2, timeout=5, strict=True), body)
    assert isinstance(out[0], CommError) and "recv(src=any, numel=1) timed out after 0.3s" in str(out[0])


def test_launch_runs_strict_thread_ranks_and_names_the_deadlock():
    def body(comm):
        comm.recv(torch.empty(1), src=1 - comm.rank)  # both receive first: nobody ever sends

    start = time.monotonic()
    with pytest.raises(sw.LaunchError, match=r"deadlock, every rank waits and none can go on"):
        sw.launch(body, 2, timeout=60)
    assert time.monotonic() - start < 10
