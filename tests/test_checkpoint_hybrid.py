"""Checkpoints of 3-D models: a (dp, tp, pp) model built by `sw.parallelize` saves each pipeline stage's names once,
with tensor-parallel boxes, and reloads bit for bit on other layouts: one process, ZeRO-3 on 4 ranks, another
(dp, tp, pp), another number of pipeline stages; two more steps then match the uninterrupted run."""

from __future__ import annotations

import pytest
import torch
from checkpoint_cases import state_equal
from compose_cases import load_and_resave, optimizer
from parity import CONFIG, RTOL, batch
from sharding_cases import wrap

import shardwise as sw
from shardwise.checkpoint import read_tensors
from shardwise.models import GPT

ATOL_TP = 1e-5


def build(comm, name):
    """'3d:dp,tp,pp:strategy' through sw.parallelize, 'zero3' / 'plain' over the whole world."""
    if name == "plain":
        return GPT(CONFIG, seed=0), 0, 1
    if name == "zero3":
        return wrap(GPT(CONFIG, seed=0), comm, "zero3"), comm.rank, comm.size
    _, sizes, strategy = name.split(":")
    dp, tp_size, pp_size = map(int, sizes.split(","))
    mesh = sw.Mesh(comm, dp=dp, tp=tp_size, pp=pp_size)
    model = sw.parallelize(GPT(CONFIG, seed=0), mesh, tp_plan="gpt" if tp_size > 1 else None, dp_strategy=strategy,
                           n_microbatches=4)
    return model, mesh.coords.dp, dp


def train(comm, name, steps, load=None, save=None):
    model, dp_rank, dp = build(comm, name)
    opt = optimizer(model.parameters())
    start = sw.load_checkpoint(load, model, opt, comm=comm)["step"] if load is not None else 0
    for step in range(start, start + steps):
        x, y = batch(step, dp_rank, dp)
        loss = model.step(x, y) if isinstance(model, sw.HybridModel) else model(x, y)
        if not isinstance(model, sw.HybridModel):
            loss.backward()
        opt.step()
        opt.zero_grad()
    if save is not None:
        sw.save_checkpoint(save, model, opt, step=start + steps, comm=comm)
    return sw.full_state_dict(model)


def world(name):
    if name == "plain":
        return 1
    if name == "zero3":
        return 4
    dp, tp_size, pp_size = map(int, name.split(":")[1].split(","))
    return dp * tp_size * pp_size


@pytest.fixture(scope="module")
def uninterrupted():
    return sw.launch(train, 1, "plain", 5)[0]


@pytest.mark.parametrize("src, dst", [
    ("3d:2,2,2:zero1", "plain"), ("3d:2,2,2:ddp", "zero3"), ("zero3", "3d:1,2,2:zero3"),
    ("3d:1,1,2:ddp", "3d:1,1,4:ddp"),
])
def test_3d_checkpoints_reload_on_any_layout(tmp_path, src, dst, uninterrupted):
    first, second = tmp_path / "first", tmp_path / "second"
    sw.launch(train, world(src), src, 3, None, first)
    before = read_tensors(first)
    assert "param/tok_emb.weight" in before and "param/head.weight" not in before  # tied: written once
    assert before["param/blocks.1.mlp.fc.weight"].shape == (CONFIG.ff_dim, CONFIG.d_model)
    sw.launch(load_and_resave, world(dst), build, dst, first, second)
    assert state_equal(before, read_tensors(second)) == []
    resumed = sw.launch(train, world(dst), dst, 2, first)[0]
    for key, want in uninterrupted.items():
        torch.testing.assert_close(resumed[key], want, rtol=RTOL, atol=ATOL_TP, msg=lambda m: f"{key}: {m}")


def test_export_and_import_full_through_a_pipeline(tmp_path):
    def body(comm):
        mesh = sw.Mesh(comm, dp=1, tp=2, pp=2)
        model = sw.parallelize(GPT(CONFIG, seed=0), mesh, tp_plan="gpt")
        sw.export_full(tmp_path / "full.safetensors", model, comm=comm)
        other = sw.parallelize(GPT(CONFIG, seed=5), sw.Mesh(comm, dp=1, tp=2, pp=2), tp_plan="gpt")
        sw.import_full(tmp_path / "full.safetensors", other)
        return sw.full_state_dict(other)

    got = sw.launch(body, 4)[0]
    from safetensors.torch import load_file

    plain = GPT(CONFIG, seed=1)
    plain.load_state_dict(load_file(str(tmp_path / "full.safetensors")))  # plain PyTorch reads the export
    for name, value in GPT(CONFIG, seed=0).state_dict().items():
        assert torch.equal(got[name], value) and torch.equal(plain.state_dict()[name], value), name
