"""`sw.parallelize` over a mesh with context-parallel and expert-parallel axes: three AdamW steps with a binding clip
equal one process on the global batch; combinations not supported yet are refused at wrap time by name.

Every rank of a cp group is given its dp rank's part of the global batch and `step` splits each sequence itself
(zigzag); the dense gradients average over dp x cp (mesh.dp_cp), the experts over mesh.edp."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise.data import ByteCorpus
from shardwise.models import GPT, GPTConfig

DENSE = GPTConfig(vocab_size=256, seq_len=32, d_model=32, n_heads=4, n_layers=2)
MOE = GPTConfig(vocab_size=256, seq_len=32, d_model=32, n_heads=4, n_layers=2, n_experts=4, experts_per_token=2,
                moe_aux_loss_coef=0.0)
CORPUS = ByteCorpus(max_bytes=100_000)
STEPS, MAX_NORM, BATCH = 3, 0.05, 4


def batch(step):
    return CORPUS.batch(step, BATCH, DENSE.seq_len)


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-5, weight_decay=0.1)


def reference(config):
    model = GPT(config, seed=0)
    opt = optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def train(comm, config, axes, options):
    mesh = sw.Mesh(comm, **axes)
    model = sw.parallelize(GPT(config, seed=0), mesh, **options)
    opt = optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        dp = mesh.sizes["dp"]
        part = slice(mesh.coords.dp * BATCH // dp, (mesh.coords.dp + 1) * BATCH // dp)
        loss = model.step(x[part], y[part])
        sw.clip_grad_norm_(model, MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return sw.full_state_dict(model), losses


CASES = {
    "dp2_cp2_ring": (DENSE, {"dp": 2, "cp": 2}, {}),
    "cp2_ulysses": (DENSE, {"dp": 1, "cp": 2}, {"cp_method": "ulysses"}),
    "cp2_pp2": (DENSE, {"dp": 1, "cp": 2, "pp": 2}, {"n_microbatches": 2}),
    "dp2_cp2_zero3": (DENSE, {"dp": 2, "cp": 2}, {"dp_strategy": "zero3"}),
    "dp2_ep2": (MOE, {"dp": 2, "ep": 2}, {}),
    "dp2_cp2_ep4": (MOE, {"dp": 2, "cp": 2, "ep": 4}, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_five_d_mesh_trains_like_one_process(case):
    config, axes, options = CASES[case]
    want, want_losses = reference(config)
    world = axes.get("dp", 1) * axes.get("cp", 1) * axes.get("pp", 1)
    for state, losses in sw.launch(train, world, config, axes, options):
        if axes.get("dp", 1) == 1:  # the step's loss is the whole batch's (a dp rank reports its own part's)
            assert losses == pytest.approx(want_losses, rel=1e-5)
        assert set(state) == set(want)
        for name in want:
            torch.testing.assert_close(state[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("axes, options, match", [
    ({"dp": 1, "cp": 2, "tp": 2}, {"tp_plan": "gpt", "cp_method": "bogus"}, r"cp_method='bogus'; allowed"),
    ({"dp": 4, "ep": 2}, {"dp_strategy": "fsdp:hybrid_shard", "dp_shard": 2}, r"ep=2 with dp_strategy='fsdp:hybrid"),
])
def test_combinations_not_supported_yet_are_refused_by_name(axes, options, match):
    config = MOE if axes.get("ep", 1) > 1 else DENSE

    def body(comm):
        with pytest.raises(ValueError, match=match):
            sw.parallelize(GPT(config, seed=0), sw.Mesh(comm, **axes), **options)
        return True

    assert all(sw.launch(body, 4))
