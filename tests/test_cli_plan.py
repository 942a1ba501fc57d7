"""`shardwise plan`: the ZeRO paper's Figure 1 from the command line, a recommendation that fits on 24 GB GPUs,
activations, --model, and usage errors before torch is needed."""

from __future__ import annotations

import re
import textwrap

import pytest

from shardwise_cli import PLAN_ATTENTION, PLAN_DTYPES, PLAN_OPTIMIZERS, main


def _plan(capsys, *args: str) -> str:
    assert main(["plan", *args]) == 0
    return capsys.readouterr().out


def _rows(text: str) -> dict[str, list[str]]:
    """strategy label -> the table's columns after it (states, activ., total, cpu, wire, comm s, fits)."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"  (\S.*?)\s{2,}(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(yes|no)", line)
        if m and m.group(1) != "strategy":
            rows[m.group(1)] = list(m.groups()[1:])
    return rows


def test_vocabulary_matches_the_planner():
    from shardwise.planner import costs

    assert PLAN_OPTIMIZERS == tuple(sorted(costs.OPTIMIZER_BYTES))
    assert PLAN_DTYPES == tuple(sorted(costs.DTYPE_BYTES))
    assert PLAN_ATTENTION == costs.ATTENTION


def test_reproduces_zero_figure_1(capsys):
    out = _plan(capsys, "--params", "7.5e9", "--gpus", "64")
    rows = _rows(out)
    psi, n, k = 7.5e9, 64, 12  # the paper's definitions: 2Ψ + 2Ψ + KΨ, sharded per stage
    want = {"ddp": (4 + k) * psi, "zero1": 4 * psi + k * psi / n, "zero2": 2 * psi + (2 + k) * psi / n,
            "zero3": (4 + k) * psi / n}
    assert {s: float(rows[s][0]) for s in want} == {s: round(v / 1e9, 1) for s, v in want.items()}
    assert [float(rows[s][0]) for s in ("ddp", "zero1", "zero2", "zero3")] == [120.0, 31.4, 16.6, 1.9]
    assert "Chosen: " in out and "16 bytes per parameter" in out


def test_7b_on_four_24gb_gpus_recommends_a_configuration_that_fits(capsys):
    out = _plan(capsys, "--params", "7e9", "--gpus", "4", "--gpu-mem", "24")
    chosen = re.search(r"^Chosen: (.+?)\. ", out, re.M).group(1)
    row = _rows(out)[chosen]
    assert float(row[2]) <= 0.9 * 24 and row[-1] == "yes"
    assert "offload" in chosen  # nothing else fits: 16Ψ/4 = 28 GB even fully sharded
    assert all(r[-1] == "no" for label, r in _rows(out).items() if "offload" not in label)


def test_activations_with_seq_and_batch(capsys):
    out = _plan(capsys, "--params", "7e9", "--gpus", "8", "--seq", "4096", "--batch", "1", "--hidden", "4096",
                "--layers", "32", "--heads", "32", "--activation-checkpointing")
    s, b, h, a, layers = 4096, 1, 4096, 32, 32
    want = layers * 2 * s * b * h + s * b * h * (34 + 5 * a * s / h)  # checkpointed inputs + one layer rebuilt
    assert float(_rows(out)["zero3"][1]) == round(want / 1e9, 1)
    assert "Korthikanti" in out and "activation checkpointing on" in out


def test_model_factory(capsys, tmp_path, monkeypatch):
    (tmp_path / "mymodels.py").write_text(textwrap.dedent("""
        from shardwise.models import GPT, GPTConfig
        def tiny():
            return GPT(GPTConfig.preset("tiny"), seed=0)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    out = _plan(capsys, "--model", "mymodels:tiny", "--gpus", "2", "--seq", "32", "--batch", "4")
    from shardwise.models import GPT, GPTConfig

    count = sum(p.numel() for p in GPT(GPTConfig.preset("tiny"), seed=0).parameters())
    assert f"{count:,} parameters" in out and "h=64, L=2, a=4, V=256" in out


@pytest.mark.parametrize("args, message", [
    (["--params", "seven"], "argument --params: 'seven' is not a parameter count"),
    (["--params", "7e9", "--gpus", "0"], "argument --gpus: 0 must be >= 1"),
    (["--params", "7e9", "--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
    (["--params", "7e9", "--seq", "128"], "--seq and --batch go together"),
    (["--gpus", "4"], "give exactly one of --params or --model"),
    (["--params", "7e9", "--gpus", "4", "--gpus-per-node", "3"], "--gpus-per-node 3 must divide --gpus 4"),
    (["--model", "nocolon"], "'nocolon' is not module:factory"),
])
def test_usage_errors(capsys, args, message):
    with pytest.raises(SystemExit) as info:
        main(["plan", *args])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_strategy_and_impossible_fit_are_one_line_errors(capsys):
    assert main(["plan", "--params", "7e9", "--gpus", "4", "--strategy", "zero9"]) == 1
    assert "strategy='zero9' is not known; allowed" in capsys.readouterr().err
    assert main(["plan", "--params", "7e9", "--gpus", "4", "--gpu-mem", "24", "--no-offload"]) == 1
    err = capsys.readouterr().err
    assert "no strategy fits" in err and re.search(r"smallest world size that would fit is \d+ ranks", err)
    assert main(["plan", "--model", "no_such_module_xyz:build"]) == 1
    assert "cannot build --model no_such_module_xyz:build: ModuleNotFoundError" in capsys.readouterr().err
