"""CommStats separates the logical cost of a collective (`wire_bytes`, the ring formula the strategy tests check)
from what the backend really moved (`transport_bytes`): gloo runs a reduce-scatter as a whole all-reduce, so it moves
twice the formula; with `scratch_input=True` it does so in place (no clone of the input) with the same result."""

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


@pytest.mark.multiprocess
def test_gloo_reduce_scatter_in_place_matches_and_counts_its_transport():
    for rank, result in enumerate(sw.launch(_reduce_scatter_both_ways, 2, backend="gloo", timeout=60)):
        for op, (plain, scratch, wire, transport) in result.items():
            full = torch.arange(16, dtype=torch.float32) * 3  # ranks 1 and 2 times the same values
            want = full[rank * 8 : (rank + 1) * 8] / (2 if op == "AVG" else 1)
            assert torch.equal(plain, want) and torch.equal(scratch, want), op
            payload = 16 * 4
            assert wire == payload // 2 and transport == payload  # (N-1)/N formula; gloo moves 2(N-1)/N


def test_thread_backend_moves_what_the_formula_says():
    for result in sw.launch(_reduce_scatter_both_ways, 2):
        for _, _, wire, transport in result.values():
            assert transport == wire == 16 * 4 // 2
