"""Crash safety (a saving process killed at random points) and clear errors for every kind of bad checkpoint."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import shardwise as sw
from shardwise.checkpoint import CheckpointError, read_tensors
from shardwise.models import GPT, GPTConfig

SMALL = GPTConfig.preset("tiny")

_SAVER = textwrap.dedent(
    """
    import sys, torch, shardwise as sw
    from shardwise.models import GPT, GPTConfig
    root = sys.argv[1]
    comm = sw.init()
    model = sw.ZeRO(GPT(GPTConfig.preset("small"), seed=0), comm, stage=3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long)).backward()
    opt.step()
    sw.save_checkpoint(root, model, opt, step=0)
    print("READY", flush=True)
    step = 1
    while True:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        sw.save_checkpoint(root, model, opt, step=step)
        step += 1
    """
)


@pytest.mark.multiprocess
@pytest.mark.parametrize("trial", [0, pytest.param(1, marks=pytest.mark.soak), pytest.param(2, marks=pytest.mark.soak)])
def test_killed_save_leaves_the_previous_checkpoint_loadable(tmp_path, trial):
    """A saver process SIGKILLed at a seeded moment inside its stream of saves. One kill moment in make test; the
    other two (the same path, another moment: about 3 s of CPU each, a fresh interpreter building the small GPT)
    under make soak."""
    rng = random.Random(trial)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    root = tmp_path / "checkpoints"
    proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(root)], stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout.readline().strip() == b"READY"
        time.sleep(rng.uniform(0.0, 1.5))  # somewhere inside one of the following saves
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    latest = (root / "latest").read_text().strip()
    tensors = read_tensors(root)  # resolves `latest` and verifies every sha256
    step = int(latest.split("-")[1])
    assert json.loads((root / latest / "metadata.json").read_text())["step"] == step
    # Each save adds 1 to every parameter: the loaded values are consistent with the step they claim.
    first = read_tensors(root / "step-00000000")
    diff = tensors["param/ln_f.bias"] - first["param/ln_f.bias"]
    torch.testing.assert_close(diff, torch.full_like(diff, float(step)))
    leftovers = [p.name for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert len(leftovers) <= 1  # at most the save that was interrupted; never under a real name


def _saved(tmp_path):
    model = GPT(SMALL, seed=0)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)).backward()
    opt.step()
    sw.save_checkpoint(tmp_path, model, opt, step=1)
    return tmp_path / "step-00000001", model, opt


def test_truncated_file_is_named(tmp_path):
    directory, model, opt = _saved(tmp_path)
    shard = directory / "shard-00000-of-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"shard-00000-of-00001\.safetensors has 100 bytes"):
        sw.load_checkpoint(tmp_path, GPT(SMALL, seed=1), opt)


def test_corrupt_file_fails_its_checksum(tmp_path):
    directory, model, opt = _saved(tmp_path)
    shard = directory / "shard-00000-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"shard-00000-of-00001\.safetensors does not match its sha256"):
        sw.load_checkpoint(tmp_path, GPT(SMALL, seed=1))


def test_missing_file_is_named(tmp_path):
    directory, _, _ = _saved(tmp_path)
    (directory / "shard-00000-of-00001.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"shard-00000-of-00001\.safetensors is missing"):
        sw.load_checkpoint(tmp_path, GPT(SMALL, seed=1))


def test_corrupt_metadata_is_named(tmp_path):
    directory, _, _ = _saved(tmp_path)
    (directory / "metadata.json").write_text('{"format": "shardwise-checkpoint", "vers')
    with pytest.raises(CheckpointError, match=r"metadata\.json is not valid JSON"):
        sw.load_checkpoint(tmp_path, GPT(SMALL, seed=1))


def test_names_cannot_escape_the_directory(tmp_path):
    directory, _, _ = _saved(tmp_path)
    metadata = json.loads((directory / "metadata.json").read_text())
    metadata["files"]["../../evil.safetensors"] = {"sha256": "0", "bytes": 1}
    (directory / "metadata.json").write_text(json.dumps(metadata))
    with pytest.raises(CheckpointError, match=r"refusing file name '\.\./\.\./evil\.safetensors'"):
        sw.load_checkpoint(tmp_path, GPT(SMALL, seed=1))
    (tmp_path / "latest").write_text("../../etc")
    with pytest.raises(CheckpointError, match=r"not a checkpoint directory name"):
        sw.load_checkpoint(tmp_path, GPT(SMALL, seed=1))


def test_no_checkpoint_at_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        sw.load_checkpoint(tmp_path / "nothing", GPT(SMALL, seed=1))


def test_model_with_other_shapes_names_the_parameter(tmp_path):
    _saved(tmp_path)
    wider = GPT(GPTConfig.preset("tiny", d_model=128), seed=0)
    with pytest.raises(ValueError, match=r"parameter 'tok_emb.weight' has shape \(256, 128\) in the model"):
        sw.load_checkpoint(tmp_path, wider)
    deeper = GPT(GPTConfig.preset("tiny", n_layers=3), seed=0)
    with pytest.raises(CheckpointError, match=r"parameter 'blocks.2.ln1.weight' is not in the checkpoint"):
        sw.load_checkpoint(tmp_path, deeper)


def test_rng_states_are_restored(tmp_path):
    torch.manual_seed(123)
    random.seed(5)
    _saved(tmp_path)
    expected = (torch.rand(3), random.random())
    torch.manual_seed(999)
    random.seed(999)
    sw.load_checkpoint(tmp_path, GPT(SMALL, seed=1))
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]


def test_export_full_loads_into_plain_pytorch(tmp_path):
    def body(comm):
        model = sw.ZeRO(GPT(SMALL, seed=3), comm, stage=3)
        sw.export_full(tmp_path / "model.safetensors", model)
        return sw.full_state_dict(model)

    state = sw.launch(body, 2)[0]
    plain = GPT(SMALL, seed=0)
    plain.load_state_dict(load_file(str(tmp_path / "model.safetensors")))  # no shardwise involved
    for key, value in plain.state_dict().items():
        assert torch.equal(value, state[key]), key

    def reimport(comm):
        model = sw.ZeRO(GPT(SMALL, seed=0), comm, stage=1)
        sw.import_full(tmp_path / "model.safetensors", model)
        return sw.full_state_dict(model)

    for reloaded in sw.launch(reimport, 2):
        assert all(torch.equal(reloaded[k], state[k]) for k in state)


def test_bad_save_arguments():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="step=-1"):
        sw.save_checkpoint("x", model, step=-1)
    with pytest.raises(ValueError, match="keep_last=0"):
        sw.save_checkpoint("x", model, step=1, keep_last=0)
    with pytest.raises(ValueError, match="JSON-serialisable"):
        sw.save_checkpoint("x", model, step=1, data=object())


def test_writes_never_follow_a_planted_link(tmp_path):
    """Issue 33: a link planted under the temporary name of the `latest` pointer or of an exported file (both named
    by the writer's pid) is removed, never written through: the file outside stays as it was."""
    outside = tmp_path / "outside.txt"
    outside.write_text("untouched")
    ckpt, export = tmp_path / "ckpt", tmp_path / "export"
    ckpt.mkdir()
    export.mkdir()
    (ckpt / f".latest.tmp-{os.getpid()}").symlink_to(outside)  # thread ranks: rank 0 is this process
    (export / f".m.safetensors.tmp-{os.getpid()}").symlink_to(outside)

    def body(comm):
        model = sw.ZeRO(GPT(SMALL, seed=0), comm, stage=3)
        sw.save_checkpoint(ckpt, model, step=2)
        sw.export_full(export / "m.safetensors", model)

    sw.launch(body, 2)
    assert outside.read_text() == "untouched"
    latest = ckpt / "latest"
    assert not latest.is_symlink() and latest.read_text().strip() == "step-00000002"
    assert not (export / "m.safetensors").is_symlink() and load_file(str(export / "m.safetensors"))


def test_run_folder_writes_never_follow_a_planted_link(tmp_path):
    """Issue 33: the benchmark report and the demo's outputs, written into a folder that already holds links (to a
    file outside, under a result's own name and under its temporary name), replace the links and leave the file
    outside as it was."""
    from shardwise.benchmarks.report import write_report
    from shardwise.benchmarks.suite import BenchResult
    from shardwise.files import save_figure, write_text

    outside = tmp_path / "outside.txt"
    outside.write_text("untouched")
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.md").symlink_to(outside)
    (run / f".results.jsonl.tmp-{os.getpid()}").symlink_to(outside)
    (run / "plot.png").symlink_to(outside)
    config = {"preset": "tiny", "nproc": 2, "batch_size": 2, "lr": 1e-3, "warmup": 1, "rounds": 1, "steps": 1,
              "memory_steps": 1}
    header = {"config": config, "num_params": 1000, "seq_len": 8, "tokens_per_step": 32, "torch": "x", "python": "x",
              "cpus": 2, "loadavg_before": 0, "loadavg_after": 0, "wall_s": 1, "started": "now"}
    write_report(BenchResult(run, [], header))
    write_text(run / "notes.txt", "fresh")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, _ = plt.subplots()
    save_figure(fig, run / "plot.png", dpi=50)
    plt.close(fig)
    assert outside.read_text() == "untouched"
    for name in ("results.md", "results.jsonl", "plot.png"):
        assert not (run / name).is_symlink() and (run / name).stat().st_size > 0, name
    assert (run / "results.jsonl").read_text().startswith('{"run": {"config"')


@pytest.mark.parametrize("wrap", ["ddp", "tp"])
def test_replicas_that_drifted_apart_are_named_at_save(tmp_path, wrap):
    """Issue 33: copies made to differ by 1e-3 in one tensor on one rank: save raises naming the tensor and the ranks
    (DDP: every parameter replicated over dp; tensor parallel: the LayerNorms replicated over tp); replicas that
    agree pass sw.check_replicas and save."""
    def body(comm):
        model = GPT(SMALL, seed=0)
        model = sw.DDP(model, comm) if wrap == "ddp" else sw.tensor_parallel.parallelize(model, comm, "gpt")
        sw.check_replicas(model)  # equal copies: nothing to say
        sw.save_checkpoint(tmp_path / "good", model, step=1)
        if comm.rank == 1:
            with torch.no_grad():
                dict(model.named_parameters())["ln_f.weight"][3] += 1e-3
        with pytest.raises(sw.ReplicaMismatch, match=r"ln_f.weight: ranks \[0\] / \[1\] hold different copies"):
            sw.save_checkpoint(tmp_path / "bad", model, step=2)
        return True

    assert sw.launch(body, 2) == [True, True]
    assert not (tmp_path / "bad" / "step-00000002").exists()
