"""Checkpoints of any layout: a dp x tp model (DDP, ZeRO, plain) saved and reloaded on another layout, another
strategy and another world size, bit for bit, and training continues as if uninterrupted; format-1 checkpoints
(flat ranges) still load; a model whose ranks span several groups refuses to save without a comm.

Layout names read "dp<d>-tp<t>-<strategy>" (strategy: none, ddp, zero1, zero3). The global batch is parity.py's 8.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from checkpoint_cases import state_equal
from compose_cases import load_and_resave, optimizer
from parity import CONFIG, RTOL, batch
from safetensors.torch import save as safetensors_save
from sharding_cases import wrap

import shardwise as sw
from shardwise import tensor_parallel as tp
from shardwise.checkpoint import CheckpointError, read_tensors
from shardwise.models import GPT

EPS, ATOL_TP = 1e-5, 1e-5


def parse(name):
    dp, t, strategy = name.split("-")
    return int(dp[2:]), int(t[2:]), strategy


def build(comm, name):
    dp, t, strategy = parse(name)
    mesh = sw.Mesh(comm, dp=dp, tp=t)
    model = GPT(CONFIG, seed=0)
    if t > 1:
        model = tp.parallelize(model, mesh.tp, "gpt")
    if strategy == "ddp":
        model = sw.DDP(model, mesh.dp)
    elif strategy != "none":
        model = wrap(model, mesh.dp, strategy)
    return model, mesh


def train(comm, name, steps, load=None, save=None):
    model, mesh = build(comm, name)
    opt = optimizer(model.parameters())
    start = sw.load_checkpoint(load, model, opt, comm=comm)["step"] if load is not None else 0
    for step in range(start, start + steps):
        x, y = batch(step, mesh.coords.dp, mesh.sizes["dp"])
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    if save is not None:
        sw.save_checkpoint(save, model, opt, step=start + steps, comm=comm)
    return sw.full_state_dict(model)


def world(name):
    dp, t, _ = parse(name)
    return dp * t


@pytest.fixture(scope="module")
def uninterrupted():
    return sw.launch(train, 1, "dp1-tp1-none", 5)[0]


@pytest.mark.parametrize("src, dst", [
    ("dp1-tp2-none", "dp1-tp1-none"), ("dp1-tp2-none", "dp1-tp4-none"), ("dp2-tp2-zero3", "dp1-tp1-none"),
    ("dp2-tp2-zero3", "dp4-tp1-zero3"), ("dp4-tp1-zero3", "dp2-tp2-zero1"), ("dp2-tp2-ddp", "dp1-tp4-none"),
])
def test_any_layout_reloads_on_any_other(tmp_path, src, dst, uninterrupted):
    first, second = tmp_path / "first", tmp_path / "second"
    sw.launch(train, world(src), src, 3, None, first)
    sw.launch(load_and_resave, world(dst), build, dst, first, second)
    before, after = read_tensors(first), read_tensors(second)
    assert any(k.endswith("/exp_avg_sq") for k in before) and any(k.endswith("/step") for k in before)
    assert before["param/blocks.0.attn.qkv.weight"].shape == (3 * CONFIG.d_model, CONFIG.d_model)  # dense shapes
    assert state_equal(before, after) == []
    resumed = sw.launch(train, world(dst), dst, 2, first)[0]
    for key, want in uninterrupted.items():
        torch.testing.assert_close(resumed[key], want, rtol=RTOL, atol=ATOL_TP, msg=lambda m: f"{key}: {m}")


def test_save_without_comm_on_a_multi_group_model_refuses_before_writing(tmp_path):
    def body(comm):
        model, _ = build(comm, "dp2-tp2-ddp")
        with pytest.raises(ValueError, match=r"pass comm= \(e.g. mesh.world\)"):
            sw.save_checkpoint(tmp_path, model, optimizer(model.parameters()), step=1)
        plain = GPT(CONFIG, seed=0)  # the README call shape, on a world of one: works
        sw.save_checkpoint(tmp_path / f"plain{comm.rank}", plain, step=1)

    sw.launch(body, 4)
    assert not list(tmp_path.glob("step-*"))
    assert sorted(p.name for p in tmp_path.glob("plain*/step-00000001")) == ["step-00000001"] * 4


def _write_format1(directory, tensors):
    """A checkpoint as format 1 wrote it: each tensor's flat range cut in two pieces stored 1-D in two files."""
    files = {}
    entries = {}
    contents = [{}, {}]
    for name, value in tensors.items():
        flat = value.reshape(-1)
        cut = flat.numel() // 2
        pieces = []
        for i, (lo, hi) in enumerate(((0, cut), (cut, flat.numel()))):
            if hi > lo:
                contents[i][f"{name}@{lo}"] = flat[lo:hi].clone()
                pieces.append({"file": f"shard-0000{i}-of-00002.safetensors", "key": f"{name}@{lo}", "lo": lo, "hi": hi})
        entries[name] = {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch."), "pieces": pieces}
    directory.mkdir(parents=True)
    for i, content in enumerate(contents):
        data = safetensors_save(content)
        (directory / f"shard-0000{i}-of-00002.safetensors").write_bytes(data)
        files[f"shard-0000{i}-of-00002.safetensors"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    metadata = {"format": "shardwise-checkpoint", "version": 1, "step": 7, "world_size": 2, "strategy": "ddp",
                "extra": {}, "param_groups": [], "files": files, "tensors": entries, "rng": {}, "optim_scalars": {}}
    (directory / "metadata.json").write_text(json.dumps(metadata))
    return metadata


def test_format1_checkpoints_load_on_new_layouts(tmp_path):
    model = GPT(CONFIG, seed=3)
    state = {f"param/{k}": v.detach() for k, v in model.named_parameters()}
    _write_format1(tmp_path / "v1", state)

    def body(comm):
        model, _ = build(comm, "dp2-tp2-zero3")
        assert sw.load_checkpoint(tmp_path / "v1", model, comm=comm, restore_rng=False)["step"] == 7
        return sw.full_state_dict(model)

    got = sw.launch(body, 4)[0]
    for name, value in GPT(CONFIG, seed=3).state_dict().items():
        assert torch.equal(got[name], value), name


def test_unknown_format_version_is_named(tmp_path):
    metadata = _write_format1(tmp_path / "v9", {"param/w": torch.zeros(3)})
    (tmp_path / "v9" / "metadata.json").write_text(json.dumps(dict(metadata, version=9)))
    with pytest.raises(CheckpointError, match=r"format version 9; this shardwise writes 2 and reads \[1, 2\]"):
        read_tensors(tmp_path / "v9")
