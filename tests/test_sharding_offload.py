"""CPU offload levels: "optimizer" and "full" train to one process's parameters, leave the numbers of the same
configuration without offload bit-for-bit unchanged, and hold in host memory exactly the model states the level
names (measured by memory_stats against the ZeRO paper's per-parameter bytes, computed from the units' shard sizes).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from parity import assert_state_close, batch, frozen_model, make_optimizer
from sharding_cases import reference, train_sharded, wrap

import shardwise as sw

LEVELS = ("optimizer", "full")


@pytest.fixture(scope="module")
def plain_reference():
    return reference()[0]


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("level", LEVELS)
def test_offload_levels_match_one_process(stage, level, plain_reference):
    for state, _, _ in sw.launch(partial(train_sharded, cpu_offload=level), 2, f"zero{stage}"):
        assert_state_close(state, plain_reference)


def _bf16_run(comm, level):
    mp = sw.MixedPrecision(param_dtype=torch.bfloat16)
    return train_sharded(comm, "zero3", steps=3, mixed_precision=mp, cpu_offload=level)[0]


def test_offload_changes_no_number_under_bf16():
    """ZeRO-3 in bf16 reads its all-gathers from the device-resident compute shard ("optimizer"), a fresh host
    copy ("full") or the master itself (no offload): the same bits either way."""
    want = sw.launch(_bf16_run, 2, False)[0]
    for level in LEVELS:
        got = sw.launch(_bf16_run, 2, level)[0]
        for name in want:
            assert torch.equal(got[name], want[name]), (level, name)


def _one_step_memory(comm, stage, level):
    model = wrap(frozen_model(), comm, f"zero{stage}", cpu_offload=level)
    opt = make_optimizer(model.parameters())
    x, y = batch(0, comm.rank, comm.size)
    model(x, y).backward()
    opt.step()
    shard = sum(u["shard"] for u in model.sharding_units())
    padded = sum(u["padded"] for u in model.sharding_units())
    grad_buffer = sum(u["grad_buffer"] for u in model.sharding_units())  # padded + the used flags (grad_layout.py)
    return sw.memory_stats(model, opt), shard, padded, grad_buffer


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("level", LEVELS)
def test_host_holds_what_the_level_names(stage, level):
    """fp32 AdamW: the host holds the master shard (4 bytes), its gradient (4) and the two moments (8) per shard
    element; the device keeps what the stage computes with: ZeRO-1 the whole parameters and gradient buffer (8 per
    parameter), ZeRO-2 the whole parameters (4), ZeRO-3 a compute shard (4 per shard element, "optimizer") or
    nothing ("full")."""
    stats, shard, padded, grad_buffer = sw.launch(_one_step_memory, 2, stage, level)[0]
    adam_steps = stats.optimizer - 8 * shard  # AdamW's per-tensor `step` scalars
    assert 0 <= adam_steps < 0.01 * stats.optimizer
    assert stats.host == 16 * shard + adam_steps
    device = {1: 4 * (padded + grad_buffer), 2: 4 * padded, 3: 4 * shard if level == "optimizer" else 0}[stage]
    assert stats.device_model_states == device


def test_without_offload_nothing_is_on_the_host():
    stats = sw.launch(_one_step_memory, 2, 3, False)[0][0]
    assert stats.host == 0 and stats.device_model_states == stats.model_states


@pytest.mark.parametrize("bad", ["cpu", "params", 1, "FULL"])
def test_unknown_level_is_refused(bad):
    # sw.launch re-raises a rank's error as LaunchError, with the ValueError's message.
    with pytest.raises(Exception, match=r"cpu_offload=.* is not an offload level; allowed False/None .* 'optimizer'"):
        sw.launch(lambda comm: wrap(frozen_model(), comm, "zero3", cpu_offload=bad), 1)
