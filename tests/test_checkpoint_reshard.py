"""Sharded checkpoints reload on other world sizes and strategies, exactly, and training continues correctly."""

from __future__ import annotations

import json
import threading
import time

import pytest
from checkpoint_cases import load_and_resave, reference, state_equal, train
from parity import assert_state_close

import shardwise as sw
from shardwise.checkpoint import read_tensors


@pytest.mark.parametrize(
    "src, src_world, dst, dst_world",
    [("zero3", 4, "zero1", 2), ("zero3", 4, "ddp", 3), ("ddp", 3, "zero3", 4), ("zero1", 2, "zero3", 4),
     ("shard_grad_op", 2, "zero2", 3), ("no_shard", 2, "hybrid_shard", 4)],
)
def test_reshard_is_exact_and_training_continues(tmp_path, src, src_world, dst, dst_world):
    first, second = tmp_path / "first", tmp_path / "second"
    sw.launch(train, src_world, src, 3, None, first)
    metadata = json.loads((first / "step-00000003" / "metadata.json").read_text())
    assert metadata["world_size"] == src_world and metadata["strategy"].removeprefix("fsdp:") == src and metadata["step"] == 3
    assert metadata["extra"] == {"data": {"next_step": 3}}
    assert len(metadata["files"]) == src_world  # every rank wrote its own file
    # Load on the new layout and save again: every parameter and every Adam tensor (exp_avg, exp_avg_sq, step)
    # comes back bit for bit.
    extras = sw.launch(load_and_resave, dst_world, dst, first, second)
    assert extras[0] == {"data": {"next_step": 3}, "step": 3}
    before, after = read_tensors(first), read_tensors(second)
    assert any(k.endswith("/exp_avg_sq") for k in before) and any(k.endswith("/step") for k in before)
    assert state_equal(before, after) == []
    # Continuing on the new layout matches the uninterrupted single-process run.
    resumed = sw.launch(train, dst_world, dst, 2, first)[0]
    assert_state_close(resumed, reference(5))


def test_checkpoint_layout_and_latest(tmp_path):
    sw.launch(train, 2, "zero3", 1, None, tmp_path)
    sw.launch(train, 2, "zero3", 1, tmp_path, tmp_path)  # resumes from latest (step 1), saves step 2
    assert (tmp_path / "latest").read_text().strip() == "step-00000002"
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["latest", "step-00000001", "step-00000002"]  # no temporary directory left behind
    assert sorted(p.name for p in (tmp_path / "step-00000002").iterdir()) == [
        "metadata.json", "shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"]


def test_keep_last_prunes_old_checkpoints(tmp_path):
    def body(comm):
        from checkpoint_cases import build

        model = build(comm, "zero2")
        for step in range(5):
            sw.save_checkpoint(tmp_path, model, step=step, keep_last=2)

    sw.launch(body, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000003", "step-00000004"]


def test_async_save_snapshots_then_writes_in_background(tmp_path):
    def body(comm):
        import torch
        from checkpoint_cases import build

        model = build(comm, "zero3")
        before = sw.full_state_dict(model)
        handle = sw.save_checkpoint(tmp_path, model, step=7, async_save=True)
        with torch.no_grad():  # training goes on and changes the shards while the writer runs
            for p in model.parameters():
                p.add_(1.0)
        handle.wait()
        comm.barrier()
        reloaded = build(comm, "ddp")
        sw.load_checkpoint(tmp_path, reloaded)
        return state_equal(sw.full_state_dict(reloaded), before)

    assert sw.launch(body, 2) == [[], []]


def test_a_rank_whose_index_lands_just_before_rank_0_renames_the_directory_does_not_fail(tmp_path, monkeypatch):
    """Rank 0 merges the indexes and renames the save's directory as soon as every index is there; a rank used to
    fsync that directory right after writing its index, and found it gone when rank 0 was quicker (a save that raised
    FileNotFoundError on that rank, seen once under load). Rank 1's fsync of the directory after its index is slowed
    down here, which makes the race certain: the index is now the rank's last touch of the directory."""
    import shardwise.files

    fsync_dir = shardwise.files.fsync_dir

    def slow_fsync_dir(path):
        if threading.current_thread().name == "shardwise-rank1" and (path / "index-00001.json").exists():
            time.sleep(0.5)  # rank 0 merges the indexes and renames the directory meanwhile
        fsync_dir(path)

    monkeypatch.setattr(shardwise.files, "fsync_dir", slow_fsync_dir)

    def body(comm):
        from checkpoint_cases import build

        sw.save_checkpoint(tmp_path, build(comm, "zero2"), step=1)

    sw.launch(body, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001"]
