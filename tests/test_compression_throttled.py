"""sw.comm.Throttled: each operation takes latency + wire bytes / bandwidth (CommStats' count), asynchronous ones
overlap compute, the link serializes, results are exact, bad options named; compression shortens a throttled step."""

from __future__ import annotations

import time

import pytest
import torch

import shardwise as sw
from shardwise.comm import Throttled

# 100 Mbit/s: 125,000 bytes of wire take 10 ms. A 2-rank all-reduce of N bytes puts N on the wire per rank.
BW, LAT = 0.1, 5.0
PAYLOAD = 125_000  # bytes: 31,250 fp32
SLACK = 0.25  # seconds of scheduling noise allowed on a loaded 2-core machine


def test_a_synchronous_all_reduce_takes_latency_plus_bytes_over_bandwidth():
    def body(comm):
        slow = Throttled(comm, bandwidth_gbps=BW, latency_ms=LAT)
        t = torch.full((PAYLOAD // 4,), float(comm.rank))
        start = time.perf_counter()
        slow.all_reduce(t, sw.ReduceOp.AVG)
        return time.perf_counter() - start, t, comm.stats.wire_bytes()

    for elapsed, t, wire in sw.launch(body, 2):
        assert wire == PAYLOAD
        assert 0.015 <= elapsed <= 0.015 + SLACK
        assert torch.equal(t, torch.full_like(t, 0.5))  # exact: only time is simulated


def test_async_operations_overlap_compute_and_queue_on_one_link():
    def body(comm):
        slow = Throttled(comm, bandwidth_gbps=BW, latency_ms=0)
        a, b = torch.ones(PAYLOAD // 4), torch.ones(PAYLOAD // 4)
        start = time.perf_counter()
        wa = slow.all_reduce(a, async_op=True)
        wb = slow.all_reduce(b, async_op=True)
        issued = time.perf_counter() - start
        time.sleep(0.01)  # "compute" while the link is busy: hidden behind the transfers
        wa.wait()
        first = time.perf_counter() - start
        wb.wait()
        return issued, first, time.perf_counter() - start, slow.delayed_s

    for issued, first, second, charged in sw.launch(body, 2):
        assert issued < 0.01  # issuing did not wait for the link
        assert 0.010 <= first and 0.020 <= second <= 0.020 + SLACK  # b waited for a: one link
        assert charged == pytest.approx(0.020)


def test_fewer_bytes_are_delayed_less_and_ddp_runs_over_it():
    """A DDP step with FP16 compression costs half the simulated wire time of the fp32 one."""
    from parity import batch, frozen_model

    def body(comm, compression):
        slow = Throttled(comm, bandwidth_gbps=1.0, latency_ms=0)
        model = sw.DDP(frozen_model(), slow, compression=compression)
        x, y = batch(0, comm.rank, comm.size)
        before = slow.delayed_s
        model(x, y).backward()
        return slow.delayed_s - before

    fp32 = sw.launch(body, 2, None)[0]
    fp16 = sw.launch(body, 2, sw.compression.FP16())[0]
    assert fp16 == pytest.approx(fp32 / 2, rel=1e-3)


@pytest.mark.parametrize("kwargs, match", [
    (dict(bandwidth_gbps=0), r"bandwidth_gbps=0 must be a positive number of Gbit/s"),
    (dict(bandwidth_gbps=1, latency_ms=-1), r"latency_ms=-1 must be a number of milliseconds >= 0"),
])
def test_bad_options_are_named(kwargs, match):
    comm = sw.comm.ThreadWorld(1).communicators()[0]
    with pytest.raises(ValueError, match=match):
        Throttled(comm, **kwargs)
    with pytest.raises(ValueError, match="must be a shardwise Communicator"):
        Throttled("comm", bandwidth_gbps=1)
