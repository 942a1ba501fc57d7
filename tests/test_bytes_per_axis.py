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


def measure(comm, dp_strategy, sp):
    mesh = sw.Mesh(comm, dp=2, tp=2)
    model = tp.parallelize(GPT(CONFIG, seed=0), mesh.tp, "gpt", sequence_parallel=sp)
    local_bytes = sum(p.numel() * 4 for p in model.parameters())
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
    padded = sum(u["padded"] for u in model.sharding_units()) * 4 if dp_strategy != "ddp" else 0
    return per_step, local_bytes, padded


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
    for per_step, local_bytes, padded in sw.launch(measure, 4, dp_strategy, sp):
        for world, on_tp, on_dp in per_step[1:]:  # the second step: ZeRO re-gathers what the first one updated
            assert world == {}
            assert on_tp == tp_formula(sp, 4)
            if dp_strategy == "ddp":  # ring all-reduce of the local gradient: 2 (N-1)/N x bytes, N = 2
                assert on_dp["all_reduce"]["wire_bytes"] == local_bytes and set(on_dp) == {"all_reduce"}
            else:  # ZeRO-2: reduce-scatter of gradients + all-gather of updated parameters, (N-1)/N x padded each
                assert on_dp["reduce_scatter"]["wire_bytes"] == padded // 2
                assert on_dp["all_gather"]["wire_bytes"] == padded // 2
