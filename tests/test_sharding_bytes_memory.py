"""Bytes per step against the ring formulas, memory_stats against the ZeRO formulas, estimate_memory, grouping."""

from __future__ import annotations

import math

import pytest
import torch
from parity import CONFIG, batch
from sharding_cases import padded_units, train_sharded, wrap
from torch import nn

import shardwise as sw
from shardwise.models import GPT


@pytest.mark.parametrize("name", ["zero1", "zero2", "shard_grad_op"])
@pytest.mark.parametrize("world", [2, 4])
def test_stage_1_2_bytes_equal_ddp(name, world):
    padded, _, _, reduced = padded_units(name, world)
    psi_bytes, flag_bytes = 4 * sum(padded), 4 * (sum(reduced) - sum(padded))
    per_step = sw.launch(train_sharded, world, name, 3)[0][1]
    for step in per_step[1:]:  # from the 2nd step on, the post-step all-gather is in every step
        # The reduce-scatter also carries one used flag per trainable tensor in each rank's chunk (grad_layout.py).
        assert step["reduce_scatter"]["bytes"] == psi_bytes + flag_bytes
        assert step["all_gather"]["bytes"] == psi_bytes
        wire = step["reduce_scatter"]["wire_bytes"] + step["all_gather"]["wire_bytes"]
        assert wire == 2 * (world - 1) * psi_bytes // world + (world - 1) * flag_bytes // world  # DDP's + the flags


@pytest.mark.parametrize("world", [2, 4])
def test_stage_3_bytes_are_one_and_a_half_ddp(world):
    padded, root, last, reduced = padded_units("zero3", world)
    psi_bytes, flag_bytes = 4 * sum(padded), 4 * (sum(reduced) - sum(padded))
    kept = 4 * (root + last)
    for step in sw.launch(train_sharded, world, "zero3", 2)[0][1]:
        assert step["reduce_scatter"]["bytes"] == psi_bytes + flag_bytes
        # Forward gathers every unit; backward re-gathers all but the root unit and the last forward unit, which
        # stay gathered from forward into backward (they run first in backward anyway), as torchtitan's FSDP2
        # setting does for its last block.
        assert step["all_gather"]["bytes"] == 2 * psi_bytes - kept
        wire = step["reduce_scatter"]["wire_bytes"] + step["all_gather"]["wire_bytes"]
        assert wire == (world - 1) * (3 * psi_bytes - kept + flag_bytes) // world


@pytest.mark.parametrize("world", [2, 4])
def test_no_shard_bytes_equal_ddp(world):
    params = list(GPT(CONFIG, seed=0).parameters())
    psi_bytes = 4 * sum(p.numel() for p in params)
    flag_bytes = 4 * len(params)  # one used flag per trainable tensor rides in the all-reduce (grad_layout.py)
    for step in sw.launch(train_sharded, world, "no_shard", 2)[0][1]:
        assert set(step) == {"all_reduce"}  # the size-1 shard groups' trivial collectives are skipped
        assert step["all_reduce"]["bytes"] == psi_bytes + flag_bytes
        assert step["all_reduce"]["wire_bytes"] == 2 * (world - 1) * (psi_bytes + flag_bytes) // world


def _memory_body(comm, name):
    model = wrap(GPT(CONFIG, seed=0), comm, name)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = batch(0, comm.rank, comm.size)
    model(x, y).backward()
    opt.step()
    stats = sw.memory_stats(model, opt)
    steps = sum(s["step"].numel() * s["step"].element_size() for s in opt.state.values())
    return stats, steps, comm.rank, model.sharding_units()


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3"])
def test_memory_stats_equal_zero_formulas(name):
    world = 4
    for stats, step_bytes, rank, units in sw.launch(_memory_body, world, name):
        # fp32 Adam: parameters 4, gradients 4, optimizer state 8 bytes per element (the ZeRO paper's K = 8 case,
        # the parameters being their own master copy). Ψ counts the padded flat buffers; a sharded quantity is
        # Ψ / N, and the optimizer state covers the real (unpadded) elements of this rank's shard.
        psi = sum(u["padded"] for u in units)
        owned = sum(min(u["shard"], max(0, u["params"] - rank * u["shard"])) for u in units)
        assert psi == sum(math.ceil(u["params"] / world) * world for u in units)
        assert stats.params == 4 * (psi if name in ("zero1", "zero2") else psi // world)
        # The gradient reduction's buffer carries one used flag per trainable tensor in each rank's chunk
        # (grad_layout.py): ZeRO-1 keeps that buffer; ZeRO-2/3's gradients view the reduced chunk, band included.
        flags = sum(u["flags"] for u in units)
        assert stats.grads == 4 * (psi + world * flags if name == "zero1" else psi // world + flags)
        assert stats.optimizer == 8 * owned + step_bytes
        if name == "zero3":  # at most two units gathered at once (prefetch) besides the root unit
            largest = sorted(u["padded"] for u in units[:-1])[-2:]
            assert 4 * max(largest) <= stats.gathered_peak <= 4 * (sum(largest) + units[-1]["padded"])
        else:
            assert stats.gathered_peak == 0


def test_estimate_memory_reproduces_zero_figure_1():
    psi, n = 7_500_000_000, 64
    got = {s: round(sw.estimate_memory(psi, s, n).total_gb, 1) for s in ("ddp", "zero1", "zero2", "zero3")}
    assert got == {"ddp": 120.0, "zero1": 31.4, "zero2": 16.6, "zero3": 1.9}


def test_estimate_memory_of_a_module_and_errors():
    model = nn.Linear(10, 10)
    est = sw.estimate_memory(model, "zero3", 2, mixed_precision=False)
    assert est.num_params == 110 and est.total == 16 * 110 / 2
    with pytest.raises(ValueError, match="strategy='zero4'"):
        sw.estimate_memory(10, "zero4", 2)
    with pytest.raises(ValueError, match="world_size=0"):
        sw.estimate_memory(10, "zero1", 0)
    with pytest.raises(ValueError, match="optimizer='lion'"):
        sw.estimate_memory(10, "zero1", 2, optimizer="lion")


class _ThousandLayers(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*[nn.Linear(16, 16) for _ in range(1000)])

    def forward(self, x):
        return self.layers(x).square().mean()


def test_thousand_tiny_layers_need_few_collectives():
    def body(comm, policy):
        model = sw.ZeRO(_ThousandLayers(), comm, stage=3, wrap=policy)
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(comm.rank))
        with comm.stats.measure() as step:
            model(x).backward()
        return step.calls("all_gather") + step.calls("reduce_scatter"), len(model.sharding_units())

    grouped, n_units = sw.launch(body, 2, "auto")[0]
    per_layer, n_layer_units = sw.launch(body, 2, nn.Linear)[0]
    # The default group size (~1/8 of the model, at least 2 MiB: below that a collective is latency-bound) merges the
    # 1,000 layers (1.1 MB) into one unit: 1000x fewer collectives than one unit per layer.
    assert n_layer_units == 1001 and n_units <= 50  # 1000 layers + an empty root unit
    assert per_layer >= 20 * grouped, (per_layer, grouped)


def test_thousand_tiny_layers_keep_the_zero3_memory_formula():
    """Model states per rank within 5% of 16 Psi / N (fp32 Adam) with the default grouping: padding stays small."""
    def body(comm):
        model = sw.ZeRO(_ThousandLayers(), comm, stage=3)
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(4, 16)).backward()
        opt.step()
        return sw.memory_stats(model, opt).model_states

    psi = 1000 * (16 * 16 + 16)
    for world in (2, 4):
        for states in sw.launch(body, world):
            assert abs(states - 16 * psi / world) <= 0.05 * 16 * psi / world, (world, states)


def test_bad_configurations_are_value_errors():
    comm = sw.init()
    with pytest.raises(ValueError, match="stage=4 is not supported"):
        sw.ZeRO(nn.Linear(2, 2), comm, stage=4)
    with pytest.raises(ValueError, match="sharding='zero3' is not supported"):
        sw.FSDP(nn.Linear(2, 2), comm, sharding="zero3")
    with pytest.raises(ValueError, match="hybrid_shard needs shard_size"):
        sw.FSDP(nn.Linear(2, 2), comm, sharding="hybrid_shard")
    with pytest.raises(ValueError, match="shard_size=2 only applies"):
        sw.FSDP(nn.Linear(2, 2), comm, shard_size=2)
    with pytest.raises(ValueError, match="group_mb=0"):
        sw.ZeRO(nn.Linear(2, 2), comm, stage=3, group_mb=0)
    with pytest.raises(ValueError, match="wrap='everything' is not a wrap policy"):
        sw.ZeRO(nn.Linear(2, 2), comm, stage=3, wrap="everything")
    with pytest.raises(ValueError, match="param_dtype=torch.int8"):
        sw.MixedPrecision(param_dtype=torch.int8)
    with pytest.raises(ValueError, match="already wrapped"):
        sw.ZeRO(sw.ZeRO(nn.Linear(2, 2), comm, stage=1), comm, stage=3)


def _states_at_scale(comm, stage):
    model = sw.ZeRO(GPT(CONFIG, seed=0), comm, stage=stage)
    opt = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, CONFIG.vocab_size, (1, CONFIG.seq_len), generator=torch.Generator().manual_seed(comm.rank))
    model(ids, ids).backward()  # one sequence per rank: 64 ranks cannot split parity.py's global batch of 8
    opt.step()
    return sw.memory_stats(model, opt).model_states


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_model_states_at_64_ranks_follow_the_zero_formulas(stage):
    """The ZeRO paper's per-rank model states (fp32 Adam: 4 + 4 + 8 bytes per parameter), at 64 thread ranks, within
    2%: 4Psi + 4Psi + 8Psi/N (stage 1), 4Psi + 4Psi/N + 8Psi/N (stage 2), 16Psi/N (stage 3)."""
    n, psi = 64, sum(p.numel() for p in GPT(CONFIG, seed=0).parameters())
    formula = {1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}[stage]
    for states in sw.launch(_states_at_scale, n, stage):
        assert abs(states - formula) <= 0.02 * formula, (states, formula)
