"""bench/gpu.py's CPU smoke: `--device cpu --preset tiny` (a gloo group of one instead of NCCL) runs every
implementation in a subprocess in seconds and prints its JSON rows, the parity line and the goal ratios.

What it proves without a GPU: the script's logic (the world of one, the four wrappings, the alternation, the
tokens/s and MFU arithmetic, the goals) is sound, so a GPU session only has to run it. The figures themselves mean
nothing on 2 shared CPU cores and are not asserted; the parity is (same init, data and steps: plain PyTorch, ZeRO-3
and DDP of one rank, and FSDP2 do the same maths under autocast).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.models.gpt import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu.py"
IMPLS = ("plain", "sw_zero3", "sw_ddp", "fsdp2")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(90)
def test_the_cpu_smoke_prints_a_row_per_implementation_with_mfu_and_goals():
    proc = _run("--device", "cpu", "--preset", "tiny", "--steps", "2", "--rounds", "2", "--warmup", "1",
                "--peak-tflops", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines()]  # stdout is JSON lines only
    rows = {r["name"]: r for r in lines if "name" in r}
    assert set(rows) == set(IMPLS), proc.stdout
    for name, r in rows.items():
        assert r["steps"] == 4 and r["steps_trained"] == 5, r  # 2 rounds x 2 measured + 1 warmup
        tokens = r["batch_size"] * r["seq_len"]
        assert r["tokens_per_step"] == tokens == 4 * 32
        # tokens/s and MFU come from the median step time: 6 N tokens / t / (2 TFLOP/s)
        assert r["tokens_per_s"] == pytest.approx(tokens / (r["median_ms"] / 1e3), rel=1e-3)
        assert r["mfu"] == pytest.approx(6 * r["params"] * r["tokens_per_s"] / 2e12, abs=1e-4)
        assert r["mfu_attn"] > r["mfu"]
        assert r["peak_source"] == "--peak-tflops"
    parity = next(line["parity_max_rel_diff_vs_plain"] for line in lines if "parity_max_rel_diff_vs_plain" in line)
    assert set(parity) == {"sw_zero3", "sw_ddp", "fsdp2"}
    assert max(parity.values()) <= 1e-6, parity  # measured: bit-identical
    ratios = next(line["ratios"] for line in lines if "ratios" in line)
    assert set(ratios) == {"sw_zero3/plain_tokens_per_s", "sw_zero3/fsdp2_tokens_per_s", "sw_ddp/plain_tokens_per_s"}
    for key, e in ratios.items():
        a, b = key.split("_tokens_per_s")[0].split("/")
        assert e["ratio"] == pytest.approx(rows[a]["tokens_per_s"] / rows[b]["tokens_per_s"], abs=2e-3)
        assert e["meets_goal"] == (e["ratio"] >= float(e["goal"].split()[-1]))
    assert "goal >= 0.95" in proc.stderr and "sw_zero3/fsdp2" in proc.stderr


def test_without_a_peak_mfu_is_null_and_bf16_params_mode_runs():
    proc = _run("--device", "cpu", "--preset", "tiny", "--steps", "1", "--rounds", "1", "--warmup", "1",
                "--impls", "plain,sw_zero3,fsdp2", "--precision", "params")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    rows = {r["name"]: r for r in lines if "name" in r}
    assert set(rows) == {"plain", "sw_zero3", "fsdp2"}
    assert all(r["mfu"] is None and "pass --peak-tflops" in r["peak_source"] for r in rows.values())
    assert rows["sw_zero3"]["mixed_precision"] == "bf16 params"
    parity = next(line["parity_max_rel_diff_vs_plain"] for line in lines if "parity_max_rel_diff_vs_plain" in line)
    # bf16 parameter copies against plain's autocast: close, not equal; ZeRO-3 and FSDP2 do the same thing.
    assert 0 < parity["sw_zero3"] < 1e-2 and parity["sw_zero3"] == pytest.approx(parity["fsdp2"], rel=0.05)


def test_the_host_overhead_shape_keeps_gpt2s_tensors_at_a_narrow_width():
    """--d-model / --vocab-size: GPT-2's 12 blocks (148 tensors) with negligible compute, so that each row's step
    time on a CPU is its host work (what limits a wrapper on a fast GPU)."""
    proc = _run("--device", "cpu", "--preset", "gpt2", "--d-model", "96", "--vocab-size", "256", "--seq-len", "16",
                "--batch-size", "1", "--steps", "1", "--rounds", "1", "--warmup", "1", "--impls", "plain,sw_zero3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    rows = {r["name"]: r for r in lines if "name" in r}
    model = GPT(GPTConfig.preset("gpt2", d_model=96, vocab_size=256, seq_len=16))
    assert len(list(model.parameters())) == 148
    assert all(r["params"] == model.num_parameters() and r["tokens_per_step"] == 16 for r in rows.values())
    parity = next(line["parity_max_rel_diff_vs_plain"] for line in lines if "parity_max_rel_diff_vs_plain" in line)
    assert parity["sw_zero3"] <= 1e-6, parity


@pytest.mark.parametrize("args, needle", [
    (["--device", "cpu", "--preset", "gpt2", "--d-model", "100"], "d_model=100 must be divisible by n_heads=12"),
    (["--impls", "plain,zero9"], "allowed ('plain', 'sw_zero3', 'sw_ddp', 'fsdp2')"),
    (["--device", "cpu", "--preset", "huge"], "--preset 'huge': allowed bench, gpt2, small, tiny"),
    (["--device", "cpu", "--steps", "0"], "--steps, --rounds and --warmup must be >= 1"),
    (["--device", "cpu", "--peak-tflops", "-1"], "--peak-tflops must be > 0"),
])
def test_bad_options_are_usage_errors(args, needle, monkeypatch, capsys):
    # In-process (the script's main), so four cases do not cost four interpreter starts.
    spec = importlib.util.spec_from_file_location("bench_gpu_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit) as exc:
        module.main(args)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err
