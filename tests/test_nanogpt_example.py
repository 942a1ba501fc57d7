"""examples/nanogpt_style.py (issue 29): the same nanoGPT-shaped loop under torch DDP, sw.DDP, sw.ZeRO(stage=3) and
sw.distribute, changed only in its `wrap` line, logs the same losses at every step and evaluation (rtol 1e-5), and
each resumes exactly from its own checkpoint (full model and optimizer state dicts, torch's load_state_dict).

Two gloo processes run all four variants one after another (torch DDP needs a torch.distributed process group),
each trained 6 steps with gradient accumulation (2 micro-batches), a checkpoint at step 3, then resumed from it to
step 6. With --compile (`make soak`) the same with torch.compile on the wrapped model."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import shardwise as sw

ROOT = Path(__file__).resolve().parents[1]


def _example():
    spec = importlib.util.spec_from_file_location("nanogpt_style", ROOT / "examples" / "nanogpt_style.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["nanogpt_style"] = module  # picklable by name in the gloo processes
    spec.loader.exec_module(module)
    return module


def run_all(comm, out: str, compile_: bool):
    example = _example()
    results = {}
    for wrap in example.WRAPS:
        common = ["--wrap", wrap, "--max-iters", "6", "--eval-interval", "3", "--out", out, "--log-every", "100"]
        common += ["--compile"] if compile_ else []
        first = example.train(comm, example.parse_args(common))
        resumed = example.train(comm, example.parse_args(common + ["--resume"]))
        results[wrap] = (first, resumed)
    return results


def _check(results) -> None:
    base = results["torch_ddp"][0]
    assert sorted(base["train"]) == list(range(6)) and sorted(base["eval"]) == [0, 3]
    assert base["n_params"] == sum(p.numel() for p in _example().GPT(_example().GPTConfig.preset("tiny")).parameters())
    assert base["train"][5] < base["train"][0] - 0.2  # it learns
    for wrap, (first, resumed) in results.items():
        assert first["n_params"] == base["n_params"], wrap  # ZeRO-3's parameters count as the whole model's
        for log in ("train", "eval"):
            got, want = torch.tensor(list(first[log].values())), torch.tensor(list(base[log].values()))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=0, msg=lambda m: f"{wrap} {log}: {m}")
        # resumed at step 3 from the checkpoint: steps 3..5 exactly as the uninterrupted run
        assert sorted(resumed["train"]) == [3, 4, 5], wrap
        for step in (3, 4, 5):
            assert resumed["train"][step] == first["train"][step], (wrap, step)
        for key, value in first["state"].items():
            assert torch.equal(resumed["state"][key], value), (wrap, key)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_four_wrappers_log_the_same_losses_and_resume_exactly(tmp_path):
    _check(sw.launch(run_all, 2, str(tmp_path), False, backend="gloo", timeout=300)[0])


@pytest.mark.soak
@pytest.mark.timeout(1500)
def test_four_wrappers_compiled(tmp_path):
    _check(sw.launch(run_all, 2, str(tmp_path), True, backend="gloo", timeout=1200)[0])
