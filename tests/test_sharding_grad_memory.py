"""Bounded gradient memory: ZeRO-2/3 finish the oldest reduce-scatter when one more than `max_inflight_reductions`
is in flight, freeing its flat buffer, so the unsharded gradient held at the peak is a few units, never the whole
model's; the parity of training is unchanged (tests/test_sharding_parity.py) and so is no_sync accumulation."""

from __future__ import annotations

import pytest
from parity import batch

import shardwise as sw
from shardwise.models import GPT, GPTConfig
from shardwise.models.gpt import Block

CONFIG = GPTConfig.preset("tiny", n_layers=6)


def peak(comm, stage, inflight, accumulate):
    model = sw.ZeRO(GPT(CONFIG, seed=0), comm, stage=stage, wrap=Block, max_inflight_reductions=inflight)
    x, y = batch(0, comm.rank, comm.size)
    if accumulate:
        with model.no_sync():
            model(x, y).backward()
    model(x, y).backward()
    units = model.sharding_units()
    return sw.memory_stats(model).grad_buffer_peak, [u["grad_buffer"] * 4 for u in units]


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("inflight", [1, 2])
def test_unsharded_gradient_at_the_peak_is_bounded(stage, inflight):
    for got, sizes in sw.launch(peak, 2, stage, inflight, False):
        root, blocks = sizes[-1], sizes[:-1]
        whole = sum(sizes)
        bound = root + (inflight + 1) * max(blocks)  # the root's buffer lives through backward (head and embedding)
        assert got <= bound < whole


def test_without_the_bound_the_whole_gradient_is_held():
    for got, sizes in sw.launch(peak, 2, 2, 100, False):
        assert got == sum(sizes)


def test_accumulation_holds_the_whole_gradient_then_reduces_once():
    for got, sizes in sw.launch(peak, 2, 3, 1, True):
        assert got == sum(sizes)  # under no_sync every unit's flat buffer accumulates until the syncing backward
