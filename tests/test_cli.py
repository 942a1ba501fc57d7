"""Tests for the `shardwise` command line and the `demo` job it runs (shardwise_cli, shardwise.demo, __main__.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardwise
from shardwise_cli import main
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
        (["--strategy", "zero4"], "argument --strategy: invalid choice: 'zero4'"),
        (["--schedule", "zb_h1"], "argument --schedule: invalid choice: 'zb_h1'"),
        (["--tp", "0"], "argument --tp: 0 must be >= 1"),
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
    with pytest.raises(ValueError, match=r"strategy='zero4' is not supported; allowed \('ddp', 'zero1', .*'fsdp', 'auto'\)"):
        DemoOptions(strategy="zero4")
    assert DemoOptions(strategy="fsdp").strategy == "fsdp:full_shard"  # Lightning's name for full sharding
    with pytest.raises(ValueError, match="nproc=0"):
        DemoOptions(nproc=0)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--dp", "2", "--tp", "2", "--pp", "2", "--nproc", "3"], "dp x tp x pp = 2 x 2 x 2 = 8 ranks, but nproc=3"),
        (["--dp", "3", "--nproc", "2"], "dp x tp x pp = 3 x 1 x 1 = 3 ranks, but nproc=2"),
        (["--tp", "2", "--nproc", "3"], "nproc=3 is not a multiple of tp x pp = 2 x 1 = 2"),
        (["--tp", "3"], "tp=3 must divide the 'tiny' preset's n_heads=4"),
        (["--pp", "2", "--batch-size", "6"], "batch_size=6 (sequences per dp rank) does not split into microbatches=4"),
        (["--pp", "2", "--schedule", "interleaved_1f1b"], "schedule='interleaved_1f1b' needs virtual_stages >= 2 (got 1)"),
        (["--pp", "4", "--virtual-stages", "2", "--schedule", "interleaved_1f1b"],
         "pp x virtual_stages = 4 x 2 stages, but the 'tiny' preset has 4 pipeline layers"),
        (["--strategy", "fsdp:hybrid_shard", "--dp", "4"], "strategy='fsdp:hybrid_shard' needs dp_shard, a divisor of dp=4; got dp_shard=None"),
        (["--strategy", "zero2", "--dp-shard", "2"], "dp_shard=2 only applies to strategy='fsdp:hybrid_shard'"),
        (["--sequence-parallel"], "sequence_parallel needs tp > 1"),
        (["--cp", "2", "--nproc", "3"], "nproc=3 is not a multiple of cp x tp x pp = 2 x 1 x 1 = 2"),
        (["--cp", "2", "--dp", "2", "--nproc", "2"], "dp x cp x tp x pp = 2 x 2 x 1 x 1 = 4 ranks, but nproc=2"),
        (["--cp", "4", "--tp", "2", "--cp-method", "ulysses"], "cp_method='ulysses' needs cp=4 to divide the 'tiny' "
                                                                "preset's n_heads=4 / tp=2"),
        (["--cp", "3"], "cp=3 splits each sequence into 2 x cp = 6 zigzag chunks, but the 'tiny' preset's seq_len=32"),
        (["--cp", "8", "--cp-method", "ulysses"], "cp_method='ulysses' needs cp=8 to divide the 'tiny' preset's "
                                                   "n_heads=4"),
        (["--ep", "2", "--experts", "0"], "ep=2 splits the experts of a mixture of experts; give experts > 0"),
        (["--ep", "2", "--experts", "3"], "ep=2 must divide experts=3"),
        (["--ep", "3"], "ep=3 must divide dp x cp = 2 x 1 = 2"),
        (["--ep", "2", "--strategy", "fsdp:hybrid_shard", "--dp-shard", "2"],
         "ep=2 with strategy='fsdp:hybrid_shard' is not supported (its shard groups cut across the ranks holding the "
         "same experts, edp)"),
        (["--experts", "2", "--experts-per-token", "3"], "experts_per_token=3 must be at most experts=2"),
    ],
)
def test_inconsistent_mesh_options_are_usage_errors(argv, needle, capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        main(["demo", *argv, *FAST, "--out", str(tmp_path)])
    assert info.value.code == 2
    assert f"shardwise demo: error: {needle}" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing ran


def test_options_resolve_the_mesh_and_its_defaults():
    plain = DemoOptions()  # today's run: DDP over 2 gloo processes
    assert (plain.nproc, plain.dp, plain.tp, plain.pp, plain.backend) == (2, 2, 1, 1, "gloo")
    assert not plain.uses_mesh and plain.microbatches is None and plain.label == "ddp x2"
    cube = DemoOptions(tp=2, pp=2)  # dp defaults to 1 when tp or pp is given; thread ranks
    assert (cube.nproc, cube.dp, cube.backend, cube.microbatches) == (4, 1, "thread", 4)
    assert DemoOptions(nproc=8, tp=2, pp=2).dp == 2 and DemoOptions(dp=3).nproc == 3
    # dp only: every strategy wraps the whole model, as ddp does (no pipeline, no microbatches), on processes
    zero = DemoOptions(nproc=2, strategy="zero3")
    assert not zero.uses_mesh and zero.backend == "gloo" and zero.microbatches is None and zero.label == "zero3 x2"
    hybrid = DemoOptions(dp=4, strategy="fsdp:hybrid_shard", dp_shard=2)
    assert not hybrid.uses_mesh and hybrid.nproc == 4
    accumulate = DemoOptions(nproc=2, strategy="zero3", microbatches=2)  # asked for: through parallelize
    assert accumulate.uses_mesh and accumulate.microbatches == 2


def test_five_axis_options_resolve():
    ctx = DemoOptions(cp=2, preset="tiny")  # dp 1: the two ranks split each sequence
    assert (ctx.nproc, ctx.dp, ctx.backend, ctx.experts, ctx.uses_mesh) == (2, 1, "thread", 0, True)
    assert ctx.label == "ddp dp1 x cp2 x tp1 x pp1" and ctx.gpt_config().n_experts == 0
    moe = DemoOptions(ep=2, preset="tiny")  # dp 2 (the 2-rank run), its experts split over both
    assert (moe.nproc, moe.dp, moe.experts, moe.label) == (2, 2, 4, "ddp dp2 x tp1 x pp1, ep2")
    config = moe.gpt_config()
    assert (config.n_experts, config.experts_per_token, config.moe_aux_loss_coef) == (4, 2, 0.0)
    auto = DemoOptions(strategy="auto", ep=2, preset="tiny", memory_gb=1)
    assert auto.strategy == "ddp" and "not experts split over ep; the demo keeps DDP" in auto.planned
    # ep with a sharded strategy (experts sharded over edp) and with tp (experts whole on every tp rank)
    both = DemoOptions(dp=2, ep=2, tp=2, strategy="zero3", preset="tiny")
    assert (both.nproc, both.dp, both.label) == (4, 2, "zero3 dp2 x tp2 x pp1, ep2")
    planned = DemoOptions(strategy="auto", cp=2, dp=2, preset="tiny", memory_gb=1)  # planned over dp x cp = 4 ranks
    assert planned.strategy == "ddp" and "4 ranks" in planned.planned


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


def test_three_d_demo_reports_bytes_per_axis(tmp_path, corpus_file, capsys):
    out = tmp_path / "runs"
    argv = ["demo", "--dp", "2", "--tp", "2", "--pp", "2", "--strategy", "zero1", "--steps", "4", "--data",
            corpus_file, "--out", str(out)]
    assert main(argv + FAST) == 0  # thread ranks: the default backend for tp or pp > 1
    printed = capsys.readouterr().out
    run = _only_run_dir(out)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["options"]["backend"] == "thread" and summary["options"]["nproc"] == 8
    assert summary["mesh"] == {"dp": 2, "tp": 2, "pp": 2}
    assert printed.count("Mesh dp=2 x tp=2 x pp=2 over 8 ranks") == 1  # describe(), once, before the summary
    assert printed.index("stage 1 (pp rank 1): blocks.1, ln_f, head") < printed.index("loss (first -> final)")
    for axis in ("dp", "tp", "pp"):
        assert all(w > 0 for w in summary["wire_bytes_per_axis"][axis])
        assert f"{axis} wire bytes/step" in printed
    ops = summary["ops_per_axis"]  # rank 0 (pp stage 0)'s last step
    assert {"reduce_scatter", "all_gather"} <= set(ops["dp"])  # ZeRO-1: reduce-scatter grads, gather params
    assert "all_reduce" in ops["tp"] and ops["pp"]["send"]["wire_bytes"] > 0
    assert summary["formula_wire_bytes"] is None and summary["wire_bytes_match"] is None
    assert "MATCH" not in printed
    assert [r["coords"] for r in summary["ranks"]][:3] == [{"dp": 0, "tp": 0, "pp": 0}, {"dp": 0, "tp": 1, "pp": 0},
                                                           {"dp": 1, "tp": 0, "pp": 0}]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 4
    for r in records:  # rank 0's totals are its three axes summed
        assert r["wire_bytes"] == r["wire_bytes_dp"] + r["wire_bytes_tp"] + r["wire_bytes_pp"]
    assert torch.isfinite(torch.tensor([r["loss"] for r in records])).all()
    assert summary["final_loss"] < summary["first_loss"]
    assert summary["tokens_per_step"] == 2 * 8 * GPTConfig.preset("tiny").seq_len  # dp x batch x seq_len
    # The same global batches as plain DDP over 2 ranks, so the logged (dp-averaged) losses agree with its losses.
    ddp = DemoOptions(nproc=2, steps=4, preset="tiny", data=corpus_file, out=str(tmp_path / "ddp"), backend="thread",
                      progress=False)
    ddp_run = Path(run_demo(ddp).run_dir)
    ddp_losses = [json.loads(line)["loss"] for line in (ddp_run / "metrics.jsonl").read_text().splitlines()]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in records]), torch.tensor(ddp_losses), rtol=1e-4, atol=0)


def test_five_axis_demo_reports_cp_and_ep(tmp_path, corpus_file, capsys):
    """dp 2 x cp 2 with ep 2 on the MoE GPT (4 thread ranks): the mesh with its cp and ep groups, traffic under each
    axis's own name against the formulas, model states against estimate_memory's ep split."""
    from shardwise.context_parallel import METHODS
    from shardwise.planner import Activations, costs
    from shardwise_cli.common import CP_METHODS

    assert CP_METHODS == METHODS
    out = tmp_path / "runs"
    assert main(["demo", "--dp", "2", "--cp", "2", "--ep", "2", "--steps", "3", "--data", corpus_file, "--out",
                 str(out), *FAST]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((_only_run_dir(out) / "summary.json").read_text())
    options = summary["options"]
    assert (options["backend"], options["nproc"], options["experts"], options["cp_method"]) == ("thread", 4, 4, "ring")
    assert summary["mesh"] == {"dp": 2, "cp": 2, "ep": 2, "tp": 1, "pp": 1}
    assert "moe_aux_loss_coef=0" in printed and "4 experts per block, 2 per token" in printed
    assert printed.count("Mesh dp=2 x cp=2 x tp=1 x pp=1, ep=2 (borrowed from dp x cp; edp=2) over 4 ranks") == 1
    assert "    dp 1 cp 1: [3]" in printed and "ep groups (by dp x cp index f = dp * 2 + cp" in printed
    ops = summary["ops_per_axis"]
    assert set(ops["ep"]) == {"all_to_all"} and {"send", "recv"} <= set(ops["cp"]) and "all_reduce" in ops["dp"]
    for axis in ("dp", "cp", "ep"):
        assert min(summary["wire_bytes_per_axis"][axis]) > 0 and f"{axis} wire bytes/step" in printed
    config = GPTConfig.preset("tiny", n_experts=4, experts_per_token=2, moe_aux_loss_coef=0.0)
    model = GPT(config, seed=0)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.w_" in n or ".mlp.b_" in n)
    dense = sum(p.numel() for p in model.parameters()) - experts
    # dp: dense fp32 gradients all-reduced over dp x cp = 4, this rank's half of the experts' over edp = 2
    # (plus the routing statistics' and clipping's few bytes)
    formula = 2 * 3 / 4 * 4 * dense + 2 * 1 / 2 * 4 * experts / 2
    assert all(0 <= w - formula < 256 for w in summary["wire_bytes_per_axis"]["dp"])
    # cp: the ring's K/V blocks of every layer (+ the 4-byte average of the sequence's loss)
    ring = costs.context_parallel_wire_bytes(Activations(config.seq_len, 8, config.d_model, config.n_layers,
                                                         config.n_heads), 2, dtype="fp32")
    assert summary["wire_bytes_per_axis"]["cp"] == [ring + 4]
    records = [json.loads(line) for line in (_only_run_dir(out) / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        assert r["wire_bytes"] == sum(r[f"wire_bytes_{a}"] for a in ("dp", "cp", "ep", "tp", "pp"))
    assert [r["coords"] for r in summary["ranks"]] == [
        {"dp": d, "cp": c, "ep": c, "tp": 0, "pp": 0} for d in (0, 1) for c in (0, 1)]
    for r in summary["ranks"]:  # each rank holds the dense model and half of the experts (AdamW: + step counters)
        assert 16 * (dense + experts / 2) <= r["memory"]["model_states"] <= 16 * (dense + experts / 2) + 4 * 64
    assert summary["estimate_model_states"] == 16 * (dense + experts // 2)
    assert summary["formula_wire_bytes"] is None and torch.isfinite(torch.tensor(summary["final_loss"]))


@pytest.mark.parametrize("argv", [["--nproc", "2", "--strategy", "zero3"],
                                  ["--dp", "4", "--strategy", "fsdp:hybrid_shard", "--dp-shard", "2"]])
def test_sharded_strategy_over_dp_only(argv, tmp_path, corpus_file, capsys):
    """Over dp alone a sharded strategy wraps the whole model as DDP does (no pipeline): its bytes, counted on every
    group it declares (hybrid_shard's shard and replicate groups too), meet its formula."""
    out = tmp_path / "runs"
    assert main(["demo", *argv, "--backend", "thread", "--steps", "3", "--data", corpus_file, "--out", str(out),
                 *FAST]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((_only_run_dir(out) / "summary.json").read_text())
    assert not summary["mesh_run"] and "Mesh dp=" not in printed  # no sw.parallelize, no describe()
    assert summary["wire_bytes_per_axis"]["tp"] == [0] and summary["wire_bytes_per_axis"]["pp"] == [0]
    assert min(summary["wire_bytes_per_axis"]["dp"]) > 0
    assert {"reduce_scatter", "all_gather"} <= set(summary["ops_per_axis"]["dp"])
    assert summary["formula_wire_bytes"] and summary["wire_bytes_match"], summary["wire_bytes_per_step"]
    assert "tp wire bytes/step" in printed and "0  (tp = 1)" in printed and "MATCH" in printed
    assert torch.isfinite(torch.tensor(summary["final_loss"]))


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
                   "--out", "--backend", "--dp", "--tp", "--pp", "--dp-shard", "--schedule", "--virtual-stages",
                   "--microbatches", "--sequence-parallel", "--activation-checkpointing"):
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


@pytest.mark.multiprocess
def test_gloo_mesh_demo(tmp_path, corpus_file):
    # ZeRO-3 over dp x a 2-stage pipeline on 4 processes: the rank body and its per-axis counts survive pickling.
    opts = DemoOptions(dp=2, pp=2, strategy="zero3", steps=2, preset="tiny", data=corpus_file, out=str(tmp_path),
                       backend="gloo", progress=False)
    summary = run_demo(opts)
    assert summary.mesh == {"dp": 2, "tp": 1, "pp": 2} and len(summary.ranks) == 4
    assert min(summary.wire_bytes_per_axis["dp"]) > 0 and min(summary.wire_bytes_per_axis["pp"]) > 0
    assert summary.wire_bytes_per_axis["tp"] == [0]
    assert torch.isfinite(torch.tensor(summary.final_loss))
