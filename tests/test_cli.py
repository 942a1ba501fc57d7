"""Tests for the `shardwise` command line and the `demo` job it runs (cli.py, demo.py, __main__.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardwise
from shardwise.cli import main
from shardwise.demo import DemoOptions, lr_at, ring_all_reduce_bytes, run_demo
from shardwise.models.gpt import GPT, GPTConfig

FAST = ["--preset", "tiny", "--no-progress"]


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small text corpus (shardwise's own sources): the default stdlib corpus takes a second per rank to read."""
    text = b"\n".join(p.read_bytes() for p in sorted(Path(shardwise.__file__).parent.rglob("*.py")))
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_bytes(text)
    return str(path)


def _only_run_dir(out: Path) -> Path:
    runs = [p for p in out.iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


def _unique_grad_bytes(preset: str) -> int:
    # Independent of the demo: the tied embedding/head matrix is one Parameter, so it is counted once.
    model = GPT(GPTConfig.preset(preset), seed=0)
    assert model.head.weight is model.tok_emb.weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


# ---- argument validation --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--nproc", "0"], "argument --nproc: 0 must be >= 1"),
        (["--nproc", "two"], "argument --nproc: 'two' is not an integer"),
        (["--steps", "0"], "argument --steps: 0 must be >= 1"),
        (["--steps", "-5"], "argument --steps: -5 must be >= 1"),
        (["--batch-size", "0"], "argument --batch-size: 0 must be >= 1"),
        (["--lr", "0"], "argument --lr: 0 must be a positive number"),
        (["--lr", "nan"], "argument --lr: nan must be a positive number"),
        (["--strategy", "zero3"], "argument --strategy: invalid choice: 'zero3'"),
        (["--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
        (["--backend", "nccl"], "argument --backend: invalid choice: 'nccl'"),
        (["--data", "/no/such/corpus.txt"], "argument --data: '/no/such/corpus.txt' does not exist"),
    ],
)
def test_bad_values_are_usage_errors(argv, needle, capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        main(["demo", *argv, "--out", str(tmp_path)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert needle in err
    if "--strategy" in argv:
        assert "ddp" in err.split("choose from", 1)[1]  # the allowed values are listed
    assert not any(tmp_path.iterdir())  # nothing ran


def test_a_command_is_required(capsys):
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    assert "demo" in capsys.readouterr().err


def test_options_validate_when_built_directly():
    with pytest.raises(ValueError, match=r"strategy='fsdp' is not supported; allowed \('ddp',\)"):
        DemoOptions(strategy="fsdp")
    with pytest.raises(ValueError, match="nproc=0"):
        DemoOptions(nproc=0)


def test_lr_warms_up_then_decays_to_a_tenth():
    opts = DemoOptions(steps=100, lr=1e-3, warmup=10)
    lrs = [lr_at(s, opts) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:10]))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[-1] == pytest.approx(1e-4)


# ---- a real run on thread ranks ---------------------------------------------------------------------------------------
def test_thread_demo_writes_metrics_summary_and_plot(tmp_path, corpus_file, capsys):
    out = tmp_path / "runs"
    argv = ["demo", "--backend", "thread", "--nproc", "2", "--steps", "3", "--data", corpus_file, "--out", str(out)]
    assert main(argv + FAST) == 0
    run = _only_run_dir(out)
    printed = capsys.readouterr().out
    assert f"run directory: {run}" in printed and "MATCH" in printed and "MISMATCH" not in printed

    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records:
        assert set(r) == {"step", "loss", "lr", "step_ms", "tokens_per_s", "wire_bytes"}
        assert 0 < r["loss"] < 10 and r["step_ms"] > 0 and r["tokens_per_s"] > 0

    summary = json.loads((run / "summary.json").read_text())
    grad_bytes = _unique_grad_bytes("tiny")
    expected = 2 * (2 - 1) * grad_bytes // 2
    assert summary["grad_bytes"] == grad_bytes
    assert summary["formula_wire_bytes"] == expected
    assert summary["wire_bytes_per_step"] == [expected]  # every step, every rank
    assert all(r["wire_bytes"] == expected for r in records)
    assert summary["wire_bytes_match"] is True
    assert summary["first_loss"] == records[0]["loss"] and summary["final_loss"] == records[-1]["loss"]
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    for r in summary["ranks"]:
        assert r["peak_rss"] > 0
        # DDP with AdamW in fp32: 4 (params) + 4 (grads) + 8 (Adam moments) bytes per parameter.
        assert r["memory"]["params"] == grad_bytes
        # (plus AdamW's 4-byte step counter per parameter tensor)
        assert 2 * grad_bytes <= r["memory"]["optimizer"] <= 2 * grad_bytes + 4 * 64
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_three_ranks_match_the_formula_despite_rounding(tmp_path, corpus_file):
    # 2(N-1)/N is not an integer ratio for N = 3: per-bucket rounding must still count as a match.
    opts = DemoOptions(nproc=3, steps=2, preset="tiny", batch_size=2, data=corpus_file, out=str(tmp_path),
                       backend="thread", progress=False)
    summary = run_demo(opts)
    assert summary.formula_wire_bytes == ring_all_reduce_bytes(_unique_grad_bytes("tiny"), 3)
    assert summary.wire_bytes_match
    assert all(0 <= summary.formula_wire_bytes - w < 16 for w in summary.wire_bytes_per_step)


def test_missing_matplotlib_skips_the_plot(tmp_path, corpus_file, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    opts = DemoOptions(nproc=1, steps=1, preset="tiny", data=corpus_file, out=str(tmp_path), backend="thread",
                       progress=False)
    summary = run_demo(opts)
    run = Path(summary.run_dir)
    assert (run / "metrics.jsonl").exists() and (run / "summary.json").exists()
    assert not (run / "loss.png").exists()
    assert "matplotlib is not installed" in capsys.readouterr().out
    assert summary.wire_bytes_per_step == [0] and summary.wire_bytes_match  # a world of one sends nothing


def test_python_dash_m_help():
    result = subprocess.run([sys.executable, "-m", "shardwise", "demo", "--help"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    for option in ("--nproc", "--strategy", "--steps", "--data", "--preset", "--batch-size", "--lr", "--seed",
                   "--out", "--backend"):
        assert option in result.stdout


# ---- gloo processes -------------------------------------------------------------------------------------------------
@pytest.mark.multiprocess
def test_gloo_demo(tmp_path, corpus_file):
    opts = DemoOptions(nproc=2, steps=3, preset="tiny", data=corpus_file, out=str(tmp_path), backend="gloo",
                       progress=False)
    summary = run_demo(opts)
    assert summary.wire_bytes_match and summary.wire_bytes_per_step == [_unique_grad_bytes("tiny")]
    assert len((Path(summary.run_dir) / "metrics.jsonl").read_text().splitlines()) == 3
    assert torch.isfinite(torch.tensor(summary.final_loss))
