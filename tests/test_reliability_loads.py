"""Strict, transactional checkpoint loads (issue 12, item 4) and the checkpoint errors of item 7.

Every case asserts that the error names its cause. Models are two small Linear layers so the module stays fast.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.checkpoint import CheckpointError, CheckpointMismatch
from shardwise.checkpoint.storage import SaveLock


def net(*sizes: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(a, b) for a, b in zip(sizes, sizes[1:])])


def stepped(model: nn.Module, kind=torch.optim.AdamW, **options) -> torch.optim.Optimizer:
    opt = kind(model.parameters(), **options)
    model(torch.ones(2, model[0].in_features)).sum().backward()
    opt.step()
    opt.zero_grad()
    return opt


def snapshot(model: nn.Module, opt: torch.optim.Optimizer | None) -> list[torch.Tensor | object]:
    """Every parameter, buffer, optimizer state value and hyperparameter, copied."""
    out: list[torch.Tensor | object] = [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
    if opt is not None:
        for state in opt.state.values():
            out += [(k, v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sorted(state.items())]
        out += [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return out


def same(a: list, b: list) -> bool:
    def eq(x, y):
        if isinstance(x, tuple):
            return x[0] == y[0] and eq(x[1], y[1])
        return torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y

    return len(a) == len(b) and all(eq(x, y) for x, y in zip(a, b))


@pytest.fixture
def saved(tmp_path):
    """A checkpoint of Linear(4,8) -> Linear(8,2) with a stepped AdamW, at tmp_path/ckpt (step 1)."""
    model = net(4, 8, 2)
    opt = stepped(model)
    sw.save_checkpoint(tmp_path / "ckpt", model, opt, step=1)
    return tmp_path / "ckpt"


def test_strict_names_extra_missing_and_mismatched_tensors(tmp_path, saved):
    bigger = net(4, 8, 2, 3)
    sw.save_checkpoint(tmp_path / "big", bigger, step=1)
    model = net(4, 8, 2, seed=1)
    before = snapshot(model, None)
    with pytest.raises(CheckpointMismatch, match=r"does not have .*: param/2\.bias; param/2\.weight"):
        sw.load_checkpoint(tmp_path / "big", model)
    with pytest.raises(CheckpointMismatch, match=r"parameter '2\.weight' is not in the checkpoint"):
        sw.load_checkpoint(saved, net(4, 8, 2, 3))
    with pytest.raises(CheckpointMismatch, match=r"parameter '1\.weight' has shape \(3, 8\) in the model but \(2, 8\)"):
        sw.load_checkpoint(saved, net(4, 8, 3))
    frozen = net(4, 8, 2)
    adam_of_layer_0 = torch.optim.AdamW(frozen[0].parameters())  # the checkpoint's Adam state of 1.* belongs to nobody
    with pytest.raises(CheckpointMismatch, match=r"parameter groups differ .*\(group sizes \[2\] vs \[4\]\)"):
        sw.load_checkpoint(saved, frozen, adam_of_layer_0)
    skipped = sw.load_checkpoint(saved, frozen, adam_of_layer_0, strict=False)["skipped"]
    assert skipped["optim/1.bias/exp_avg"] == "not held by the model's optimizer" and "param_groups" in skipped
    half = net(4, 8, 2).to(torch.bfloat16)
    with pytest.raises(CheckpointMismatch, match=r"parameter '0\.weight' is bfloat16 in the model but float32 in"):
        sw.load_checkpoint(saved, half)
    assert same(snapshot(model, None), before)


def test_adamw_checkpoint_into_sgd_is_refused_and_leaves_sgd_alone(saved):
    model = net(4, 8, 2, seed=1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.5)
    before = snapshot(model, sgd)
    with pytest.raises(CheckpointMismatch, match=r"optimizer is AdamW, this one is SGD"):
        sw.load_checkpoint(saved, model, sgd)
    assert same(snapshot(model, sgd), before) and sgd.param_groups[0]["lr"] == 0.5 and not sgd.state
    extra = sw.load_checkpoint(saved, model, sgd, strict=False)  # the model loads; the optimizer is skipped
    assert extra["skipped"] == {"optimizer": "the checkpoint's optimizer is AdamW, this one is SGD"}
    assert sgd.param_groups[0]["lr"] == 0.5 and not sgd.state
    assert torch.equal(model[0].weight, sw.checkpoint.read_tensors(saved)["param/0.weight"])
    assert json.loads((saved / "step-00000001" / "metadata.json").read_text())["optimizer"] == "AdamW"


def test_non_strict_loads_what_fits_and_reports_the_rest(tmp_path, saved, caplog):
    other = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3), nn.Linear(3, 3))  # 1.* mismatch, 2.* missing
    with torch.no_grad():
        other[0].weight.fill_(7.0)
    kept = other[1].weight.detach().clone()
    with caplog.at_level(logging.WARNING, logger="shardwise.checkpoint"):
        extra = sw.load_checkpoint(saved, other, strict=False)
    assert extra["step"] == 1
    skipped = extra["skipped"]
    assert skipped["param/1.weight"] == ("parameter '1.weight' has shape (3, 8) in the model but (2, 8) in the "
                                         "checkpoint")
    assert skipped["param/2.weight"] == "parameter '2.weight' is not in the checkpoint"
    assert set(skipped) == {"param/1.weight", "param/1.bias", "param/2.weight", "param/2.bias"}
    assert torch.equal(other[0].weight, sw.checkpoint.read_tensors(saved)["param/0.weight"])  # what fits, loaded
    assert torch.equal(other[1].weight, kept)
    assert "skipped 4" in caplog.text and "param/2.weight" in caplog.text
    # Tensors the model does not have: reported, not loaded.
    small = net(4, 8)
    assert sw.load_checkpoint(saved, small, strict=False)["skipped"] == {"param/1.weight": "not in the model",
                                                                         "param/1.bias": "not in the model"}


def _one_rank_fails(comm, root, base, how):
    """ZeRO-3 over 2 ranks: change everything after the save, load with a fault only rank 1 meets, compare."""
    model = sw.ZeRO(copy.deepcopy(base), comm, stage=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    sw.save_checkpoint(root, model, opt, step=1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    opt.param_groups[0]["lr"] = 0.25
    if how in ("rng", "rng_dropout") and comm.rank == 0:
        path = root / "step-00000001" / "metadata.json"
        metadata = json.loads(path.read_text())
        metadata["rng"]["1"]["json"]["python" if how == "rng" else "dropout"] = "garbage"
        path.write_text(json.dumps(metadata))
    if how == "corrupt" and comm.rank == 0:
        shard = root / "step-00000001" / "shard-00001-of-00002.safetensors"
        data = bytearray(shard.read_bytes())
        data[-3] ^= 0xFF
        shard.write_bytes(bytes(data))
    comm.barrier()
    adamw = opt
    if how == "sgd" and comm.rank == 1:
        opt = torch.optim.SGD(model.parameters(), lr=0.25)
    loaded_opt = None if how == "corrupt" else opt  # without the optimizer, rank 0 reads only its own shard
    before = snapshot(model, opt)
    try:
        sw.load_checkpoint(root, model, loaded_opt)
        error = None
    except CheckpointError as exc:
        error = f"{type(exc).__name__}: {exc}"
    unchanged = same(snapshot(model, opt), before)
    if how != "corrupt":  # once the fault is gone the same load does change both ranks: the check above has teeth
        sw.load_checkpoint(root, model, adamw, restore_rng=False)
        assert not same(snapshot(model, adamw), before) and adamw.param_groups[0]["lr"] == 1e-2
    return unchanged, error


@pytest.mark.parametrize("how, cause", [
    ("sgd", r"CheckpointMismatch: .*optimizer is AdamW, this one is SGD"),
    ("rng", r"the RNG entry of rank 1 is malformed"),
    ("rng_dropout", r"the RNG entry of rank 1 is malformed \(dropout stream positions must be"),
    ("corrupt", r"shard-00001-of-00002\.safetensors does not match its sha256"),
])
def test_a_failure_on_one_rank_leaves_every_rank_unchanged(tmp_path, how, cause):
    base = net(4, 8, 2)
    (unchanged0, error0), (unchanged1, error1) = sw.launch(_one_rank_fails, 2, tmp_path / "ckpt", base, how)
    assert unchanged0 and unchanged1
    assert error1 is not None and re.search(cause, error1), error1
    assert error0.startswith("CheckpointError: load_checkpoint: rank 1 failed to load"), error0
    assert re.search(cause, error0) and "nothing was loaded on rank 0" in error0


def _edit_metadata(root, edit):
    path = root / "step-00000001" / "metadata.json"
    metadata = json.loads(path.read_text())
    edit(metadata)
    path.write_text(json.dumps(metadata))


def test_crafted_metadata_is_refused_naming_file_and_key(tmp_path, saved):
    pristine = (saved / "step-00000001" / "metadata.json").read_text()
    first = next(iter(json.loads(pristine)["tensors"]))
    shard = "shard-00000-of-00001.safetensors"
    cases = [
        (lambda m: m.pop("tensors"), r"metadata\.json: missing key 'tensors'"),
        (lambda m: m.pop("files"), r"metadata\.json: missing key 'files'"),
        (lambda m: m["tensors"][first].update(dtype="zeros"), r"'param/0\.weight': dtype 'zeros' is not a tensor"),
        (lambda m: m["tensors"][first].update(shape=[10**6, 10**6]),  # 10^12 elements in a file of ~2 kB
         r"'param/0\.weight': shape \[1000000, 1000000\] \(1000000000000 elements of float32\) is larger than"),
        (lambda m: m["tensors"][first]["pieces"][0].update(file="../../evil.safetensors"),
         r"refers to '\.\./\.\./evil\.safetensors', which 'files' does not list"),
        (lambda m: m["files"].update({"../../evil.safetensors": {"sha256": "0", "bytes": 1}}),
         r"refusing file name '\.\./\.\./evil\.safetensors'"),
        (lambda m: m["tensors"][first]["pieces"][0].update(box=[[0, 99], [0, 4]]),
         r"'param/0\.weight': piece 0: box \[\[0, 99\], \[0, 4\]\] is not inside shape \[8, 4\]"),
        (lambda m: m["files"][shard].pop("bytes"), r"files\['shard-00000-of-00001\.safetensors'\]: missing key"),
        (lambda m: m.update(step="one"), r"metadata\.json: key 'step' must be of type int, got str"),
        (lambda m: m["rng"]["0"].update(file="../x"), r"refusing file name '\.\./x'"),
    ]
    for edit, message in cases:
        (saved / "step-00000001" / "metadata.json").write_text(pristine)
        _edit_metadata(saved, edit)
        with pytest.raises(CheckpointError, match=message):
            sw.load_checkpoint(saved, net(4, 8, 2))


def test_symlinks_out_of_the_root_are_refused(tmp_path, saved):
    outside = tmp_path / "outside"
    shutil.copytree(saved / "step-00000001", outside)
    shard = saved / "step-00000001" / "shard-00000-of-00001.safetensors"
    shard.unlink()
    shard.symlink_to(outside / "shard-00000-of-00001.safetensors")  # the same bytes: only the place is wrong
    with pytest.raises(CheckpointError, match=r"shard-00000-of-00001\.safetensors leads outside the checkpoint root"):
        sw.load_checkpoint(saved, net(4, 8, 2))
    shutil.rmtree(saved / "step-00000001")
    (saved / "step-00000001").symlink_to(outside, target_is_directory=True)
    with pytest.raises(CheckpointError, match=r"step-00000001 leads outside the checkpoint root"):
        sw.load_checkpoint(saved, net(4, 8, 2))
    (saved / "step-00000001").unlink()
    inner = saved / "kept"
    shutil.copytree(outside, inner)
    (saved / "step-00000001").symlink_to(inner, target_is_directory=True)  # inside the root: followed
    assert sw.load_checkpoint(saved, net(4, 8, 2))["step"] == 1
    (tmp_path / "pointer").write_text("step-00000001\n")
    (saved / "latest").unlink()
    (saved / "latest").symlink_to(tmp_path / "pointer")
    with pytest.raises(CheckpointError, match=r"latest leads outside the checkpoint root"):
        sw.load_checkpoint(saved, net(4, 8, 2))


def test_directories_and_files_in_the_wrong_place(tmp_path, saved):
    shard = saved / "step-00000001" / "shard-00000-of-00001.safetensors"
    shard.unlink()
    shard.mkdir()
    with pytest.raises(CheckpointError, match=r"shard-00000-of-00001\.safetensors is a directory, expected a file"):
        sw.load_checkpoint(saved, net(4, 8, 2))
    meta = saved / "step-00000001" / "metadata.json"
    meta.unlink()
    meta.mkdir()
    with pytest.raises(CheckpointError, match=r"metadata\.json is a directory, expected a file"):
        sw.load_checkpoint(saved, net(4, 8, 2))
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(CheckpointError, match=r"afile is a file; the checkpoint root .*afile must be a directory"):
        sw.save_checkpoint(afile, net(4, 2), step=1)
    with pytest.raises(CheckpointError, match=r"afile is a file; the checkpoint root .*afile/sub must be a directory"):
        sw.save_checkpoint(afile / "sub", net(4, 2), step=1)
    with pytest.raises(CheckpointError, match=r"afile is a file; a checkpoint is a directory"):
        sw.load_checkpoint(afile, net(4, 2))


def test_the_next_save_removes_what_dead_saves_left(tmp_path):
    root = tmp_path / "ckpt"
    model = net(4, 2)
    sw.save_checkpoint(root, model, step=1)
    dead = root / ".tmp-step-00000002-0123abcd"  # a save killed while writing
    dead.mkdir()
    (dead / "shard-00000-of-00001.safetensors").write_bytes(b"x" * 1000)
    (root / ".old-step-00000001-4242").mkdir()  # killed while replacing a step (older naming: pid)
    (root / ".lock-step-00000003-0badcafe").write_text("")  # a dead save's lock file, no longer held
    (root / ".tmp-step-00000003-0badcafe").mkdir()
    live = SaveLock(root, "step-00000004-feedf00d")  # a save still in progress (another process, say)
    (root / ".tmp-step-00000004-feedf00d").mkdir()
    try:
        sw.save_checkpoint(root, model, step=2)
        assert sorted(p.name for p in root.iterdir()) == [
            ".lock-step-00000004-feedf00d", ".tmp-step-00000004-feedf00d", "latest", "step-00000001", "step-00000002"]
    finally:
        live.release()
    sw.save_checkpoint(root, model, step=2)  # re-saving a step leaves no .old-* either
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000001", "step-00000002"]
    assert not os.path.exists(root / ".lock-step-00000004-feedf00d")
