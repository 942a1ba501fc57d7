"""Communication per mesh axis: each sub-communicator counts its own traffic (CommStats), and on a dp x tp mesh
each axis carries exactly its strategy's formula per step, nothing more: tensor parallel's all-reduces (or
sequence parallel's all-gather / reduce-scatter pairs) on mesh.tp; the data-parallel strategy's reduction of this
rank's tensor-parallel slice on mesh.dp; nothing on the world communicator."""

from __future__ import annotations

import pytest
from parity import CONFIG, batch, make_optimizer
from sharding_cases import wrap

import shardwise as sw
from shardwise import tensor_parallel as tp
from shardwise.models import GPT
from shardwise.sharded_tensor import local


def measure(comm, dp_strategy, sp):
    mesh = sw.Mesh(comm, dp=2, tp=2)
    model = tp.parallelize(GPT(CONFIG, seed=0), mesh.tp, "gpt", sequence_parallel=sp)
    local_bytes = sum(local(p).numel() * 4 for p in model.parameters())  # this rank's slices
    model = sw.DDP(model, mesh.dp) if dp_strategy == "ddp" else wrap(model, mesh.dp, dp_strategy)
    opt = make_optimizer(model.parameters())
    per_step = []
    for step in range(2):
        x, y = batch(step, mesh.coords.dp, 2)
        with comm.stats.measure() as world, mesh.tp.stats.measure() as on_tp, mesh.dp.stats.measure() as on_dp:
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        per_step.append((world.as_dict(), on_tp.as_dict(), on_dp.as_dict()))
    units = model.sharding_units() if dp_strategy != "ddp" else []
    # The gradients' reduce-scatter also carries one used flag per trainable tensor in each chunk (grad_layout.py).
    return per_step, local_bytes, (sum(u["padded"] * 4 for u in units), sum(u["grad_buffer"] * 4 for u in units))


def tp_formula(sp, B):
    """tests/test_tensor_parallel_gpt.py's per-step formula for a batch of B sequences on 2 tp ranks."""
    T, d, L = CONFIG.seq_len, CONFIG.d_model, CONFIG.n_layers
    act, loss = B * T * d * 4, 3 * B * T * 4
    if not sp:
        total = (4 * L + 2) * act + loss
        return {"all_reduce": {"calls": 4 * L + 4, "bytes": total, "wire_bytes": total}}
    grads = (6 * L + 2) * d * 4 + T * d * 4
    pairs = (4 * L + 2) * act
    return {"all_gather": {"calls": 4 * L + 2, "bytes": pairs, "wire_bytes": pairs // 2},
            "reduce_scatter": {"calls": 4 * L + 2, "bytes": pairs, "wire_bytes": pairs // 2},
            "all_reduce": {"calls": 2 + 6 * L + 2 + 1, "bytes": loss + grads, "wire_bytes": loss + grads}}


@pytest.mark.parametrize("dp_strategy, sp", [("ddp", False), ("ddp", True), ("zero2", True)])
def test_each_axis_carries_its_formula(dp_strategy, sp):
    for per_step, local_bytes, (padded, reduced) in sw.launch(measure, 4, dp_strategy, sp):
        for world, on_tp, on_dp in per_step[1:]:  # the second step: ZeRO re-gathers what the first one updated
            assert world == {}
            assert on_tp == tp_formula(sp, 4)
            if dp_strategy == "ddp":  # ring all-reduce of the local gradient: 2 (N-1)/N x bytes, N = 2
                assert on_dp["all_reduce"]["wire_bytes"] == local_bytes and set(on_dp) == {"all_reduce"}
            else:  # ZeRO-2: reduce-scatter of gradients + all-gather of updated parameters, (N-1)/N x padded each
                assert on_dp["reduce_scatter"]["wire_bytes"] == reduced // 2
                assert on_dp["all_gather"]["wire_bytes"] == padded // 2


def measure_pipeline(comm, dp_strategy, m):
    mesh = sw.Mesh(comm, dp=2, tp=1, pp=2)
    model = sw.parallelize(GPT(CONFIG, seed=0), mesh, dp_strategy=dp_strategy, n_microbatches=m)
    opt = make_optimizer(model.parameters())
    stages = list(model.pipe.stages.values())
    units = [u for s in stages if hasattr(s, "sharding_units") for u in s.sharding_units()]
    reduced = sum(u["grad_buffer"] for u in units) * 4  # padded + one used flag per tensor per chunk (grad_layout)
    units = sum(u["padded"] for u in units) * 4
    # The embedding / head weight, held by both pipeline ranks, and its used flag (an int32 all-reduced first, so a
    # weight no rank used keeps grad None: unused.py); 2 ranks: an all-reduce's wire bytes equal its payload.
    tied = CONFIG.vocab_size * CONFIG.d_model * 4 + 4
    for step in range(2):
        x, y = batch(step, mesh.coords.dp, 2)
        with mesh.dp.stats.measure() as on_dp, mesh.pp.stats.measure() as on_pp:
            model.step(x, y)
            opt.step()
            opt.zero_grad()
    stage_bytes = sum(local(p).numel() * 4 for s in stages for p in s.parameters()) if dp_strategy == "ddp" else units
    return on_dp.as_dict(), on_pp.as_dict(), mesh.coords.pp, stage_bytes, tied, reduced


@pytest.mark.parametrize("dp_strategy", ["ddp", "zero3"])
def test_pipeline_axes_carry_their_formulas(dp_strategy):
    """pp: one activation per microbatch forward and one gradient back per stage boundary (plus one metadata
    message per step and the tied weight's gradient); dp: once per step after the last microbatch (DDP's
    all-reduce of the stage), or ZeRO-3's all-gather per microbatch forward and backward plus one reduce-scatter."""
    m = 4
    act = (8 // 2 // m) * CONFIG.seq_len * CONFIG.d_model * 4  # one microbatch's activation (or its gradient)
    for on_dp, on_pp, stage, stage_bytes, tied, reduced in sw.launch(measure_pipeline, 4, dp_strategy, m):
        assert on_pp["send"]["calls"] == m + (1 if stage == 0 else 0)  # + the shape message stage 0 sends first
        assert on_pp["send"]["bytes"] - (80 if stage == 0 else 0) == m * act  # shape message: 10 int64 words
        assert on_pp["all_reduce"]["wire_bytes"] == tied  # tied gradient summed over the 2 pipeline ranks
        if dp_strategy == "ddp":
            assert on_dp == {"all_reduce": {"calls": 1, "bytes": stage_bytes, "wire_bytes": stage_bytes}}
        else:
            assert on_dp["all_gather"] == {"calls": 2 * m, "bytes": 2 * m * stage_bytes, "wire_bytes": m * stage_bytes}
            assert on_dp["reduce_scatter"]["wire_bytes"] == reduced // 2
            assert on_dp["all_reduce"]["wire_bytes"] == tied  # the tied weight stays whole: all-reduced as DDP
