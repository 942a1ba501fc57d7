"""CommStats separates the logical cost of a collective (`wire_bytes`, the ring formula the strategy tests check)
from what the backend really moved (`transport_bytes`): gloo runs its own reduce-scatter as a whole all-reduce, so it
moves twice the formula; with `scratch_input=True` shardwise runs a ring over point-to-point in place instead
(comm/gloo_ring.py), which moves the formula's bytes, with the same result, also while other collectives run."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw


def _reduce_scatter_both_ways(comm):
    out = {}
    for op in (sw.ReduceOp.SUM, sw.ReduceOp.AVG):
        source = torch.arange(8 * comm.size, dtype=torch.float32) * (comm.rank + 1)
        plain, scratch = torch.empty(8), torch.empty(8)
        comm.reduce_scatter(plain, source.clone(), op)
        with comm.stats.measure() as step:
            comm.reduce_scatter(scratch, source.clone(), op, scratch_input=True)
        out[op.name] = (plain, scratch, step.wire_bytes("reduce_scatter"), step.transport_bytes("reduce_scatter"))
    return out


def _overlapped(comm):
    """A ring reduce-scatter in flight while the training thread runs an all-reduce and an all-gather."""
    source = torch.arange(8 * comm.size, dtype=torch.float32) * (comm.rank + 1)
    out = torch.empty(8)
    work = comm.reduce_scatter(out, source, sw.ReduceOp.SUM, async_op=True, scratch_input=True)
    total = torch.tensor([float(comm.rank)])
    comm.all_reduce(total)
    gathered = torch.empty(comm.size)
    comm.all_gather(gathered, torch.tensor([float(comm.rank)]))
    work.wait()
    return out, float(total), gathered


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [3, pytest.param(2, marks=pytest.mark.soak)])  # 3: the ring's general case
def test_gloo_ring_reduce_scatter_matches_and_moves_the_formula(world):
    n = 8 * world
    scale = world * (world + 1) // 2  # ranks 0..N-1 contribute (rank + 1) times the same values
    for rank, result in enumerate(sw.launch(_reduce_scatter_both_ways, world, backend="gloo", timeout=60)):
        for op, (plain, scratch, wire, transport) in result.items():
            full = torch.arange(n, dtype=torch.float32) * scale
            want = full[rank * 8 : (rank + 1) * 8] / (world if op == "AVG" else 1)
            assert torch.equal(plain, want) and torch.equal(scratch, want), op
            assert wire == (world - 1) * n * 4 // world == transport  # the ring moves the (N-1)/N formula
    for rank, (out, total, gathered) in enumerate(sw.launch(_overlapped, world, backend="gloo", timeout=60)):
        assert torch.equal(out, torch.arange(rank * 8, rank * 8 + 8, dtype=torch.float32) * scale)
        assert total == sum(range(world)) and torch.equal(gathered, torch.arange(world, dtype=torch.float32))


def test_thread_backend_moves_what_the_formula_says():
    for result in sw.launch(_reduce_scatter_both_ways, 2):
        for _, _, wire, transport in result.values():
            assert transport == wire == 16 * 4 // 2
