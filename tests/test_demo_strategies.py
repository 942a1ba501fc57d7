"""`shardwise demo` with every data-parallel strategy: its summary puts the measured wire bytes beside the strategy's
formula and the model states beside the ZeRO estimate; `fsdp` is fsdp:full_shard; --compare draws the runs
together; --early-stop stops every rank at the same step through sw.agree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import shardwise
from shardwise_cli import main
from shardwise.demo import DemoOptions, run_demo

FAST = ["--preset", "tiny", "--no-progress", "--backend", "thread"]


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    text = b"\n".join(p.read_bytes() for p in sorted(Path(shardwise.__file__).parent.rglob("*.py")))
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_bytes(text)
    return str(path)


@pytest.mark.parametrize("strategy, dp_shard", [("ddp", None), ("zero1", None), ("zero2", None), ("zero3", None),
                                                ("fsdp", None), ("fsdp:shard_grad_op", None),
                                                ("fsdp:hybrid_shard", 2)])
def test_each_strategy_meets_its_formula_and_estimate(strategy, dp_shard, corpus_file, tmp_path):
    nproc = 4 if dp_shard else 2
    s = run_demo(DemoOptions(strategy=strategy, nproc=nproc, dp_shard=dp_shard, preset="tiny", steps=3,
                             backend="thread", progress=False, data=corpus_file, out=str(tmp_path)))
    assert s.formula_wire_bytes and s.wire_bytes_match, (s.wire_bytes_per_step, s.formula_wire_bytes)
    # shard_grad_op holds its parameters sharded at rest and whole from forward through backward: the estimate is
    # that peak (ZeRO-2's), memory_stats the state at rest after the step, so only the others are compared.
    for r in s.ranks if strategy != "fsdp:shard_grad_op" else ():
        assert r["memory"]["model_states"] == pytest.approx(s.estimate_model_states, rel=0.05), r
    assert s.options["strategy"] == ("fsdp:full_shard" if strategy == "fsdp" else strategy)


def test_early_stop_stops_every_rank_together(corpus_file, tmp_path):
    # min_delta so large that no evaluation counts as an improvement after the first: patience 2 runs out at the
    # third evaluation, step 3 x eval_every - 1.
    s = run_demo(DemoOptions(strategy="zero2", preset="tiny", steps=50, backend="thread", progress=False,
                             data=corpus_file, out=str(tmp_path), early_stop=2, eval_every=3, eval_batches=1,
                             min_delta=100.0))
    assert s.stopped_at == 8 and s.steps_run == 9
    assert [int(v[0]) for v in s.validation] == [2, 5, 8]


def test_compare_writes_one_plot_per_kind_with_every_strategy(corpus_file, tmp_path, capsys, monkeypatch):
    from shardwise.demo import compare, report

    labels = {}

    def recorded(save):
        def save_figure(fig, path, dpi):
            (ax,) = fig.axes
            labels[path.name] = (ax.get_legend() is not None, ax.get_xlabel(), ax.get_ylabel())
            save(fig, path, dpi=dpi)
        return save_figure

    monkeypatch.setattr(compare, "save_figure", recorded(compare.save_figure))
    monkeypatch.setattr(report, "save_figure", recorded(report.save_figure))
    assert main(["demo", *FAST, "--steps", "3", "--data", corpus_file, "--out", str(tmp_path),
                 "--compare", "ddp,zero3,fsdp:shard_grad_op"]) == 0
    # every plot (each run's loss.png, the comparison's two) has a legend and its units
    assert set(labels) == {"loss.png", "loss_vs_time.png", "memory.png"}
    for name, (legend, xlabel, ylabel) in labels.items():
        assert legend and xlabel and any(unit in ylabel for unit in ("nats/byte", "MiB")), (name, xlabel, ylabel)
    (folder,) = tmp_path.iterdir()
    assert folder.name.endswith("-compare")
    for plot in ("loss_vs_time.png", "memory.png"):
        assert (folder / plot).read_bytes()[:4] == b"\x89PNG"
    table = (folder / "compare.md").read_text()
    for name in ("ddp", "zero3", "fsdp:shard_grad_op"):
        assert f"| {name} |" in table
    compared = json.loads((folder / "compare.json").read_text())
    runs = compared["runs"]
    assert [r["options"]["strategy"] for r in runs] == ["ddp", "zero3", "fsdp:shard_grad_op"]
    assert "alternating" in compared["method"] and "Load average" in compared["method"]
    assert all(not r["mesh_run"] for r in runs)  # over dp alone every strategy takes the path ddp takes
    # Same init, same batches: every strategy trains to the same loss.
    assert runs[1]["final_loss"] == pytest.approx(runs[0]["final_loss"], rel=1e-4)


def test_compare_alternates_blocks_in_rotating_order(monkeypatch):
    """The strategies take turns in blocks of BLOCK_STEPS steps, the first of each round rotating, so that a slow
    phase of the machine falls on all of them: never one strategy's whole run, then the next's."""
    from shardwise.comm import ThreadWorld
    from shardwise.demo import compare

    order: list[tuple[str, int]] = []

    class Recorded:  # stands in for a rank's run: records which strategy stepped when
        def __init__(self, comm, options):
            self.options, self.steps, self.done = options, 0, False

        def step(self):
            order.append((self.options.strategy, self.steps))
            self.steps += 1
            self.done = self.steps == self.options.steps

        def result(self):
            return {"strategy": self.options.strategy, "steps": self.steps}

    monkeypatch.setattr(compare, "start_run", Recorded)
    steps = 2 * compare.BLOCK_STEPS + 1
    variants = [DemoOptions(strategy=name, nproc=1, steps=steps, preset="tiny") for name in ("ddp", "zero3")]
    (comm,) = ThreadWorld(1).communicators()
    results = compare.compare_rank(comm, variants, progress=False)
    assert results == [{"strategy": "ddp", "steps": steps}, {"strategy": "zero3", "steps": steps}]
    b = compare.BLOCK_STEPS

    def block(name, first, n=b):
        return [(name, k) for k in range(first, first + n)]

    # round 1: ddp then zero3; round 2 starts with zero3; round 3 (the last step of each) with ddp again
    assert order == (block("ddp", 0) + block("zero3", 0) + block("zero3", b) + block("ddp", b)
                     + block("ddp", 2 * b, 1) + block("zero3", 2 * b, 1))


def test_compare_refuses_variants_that_differ_in_more_than_the_strategy(tmp_path):
    from shardwise.demo import run_compare

    with pytest.raises(ValueError, match="differ only in strategy; 'zero3' differs from 'ddp'"):
        run_compare([DemoOptions(strategy="ddp", nproc=2, out=str(tmp_path)),
                     DemoOptions(strategy="zero3", nproc=2, batch_size=4, out=str(tmp_path))])
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("argv, needle", [
    (["--compare", "ddp"], "must name at least two strategies"),
    (["--compare", "ddp,zero9"], "not ['zero9']; allowed: ddp, zero1"),
    (["--compare", "fsdp,fsdp:full_shard"], "names a strategy twice"),
    (["--early-stop", "0"], "argument --early-stop: 0 must be >= 1"),
])
def test_bad_compare_and_early_stop_are_usage_errors(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", *argv])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def _states_gb(strategy: str) -> float:
    """The planner's model states per rank for the tiny GPT on 2 ranks (fp32 AdamW), in GB."""
    from shardwise.planner import Links, Workload, plan

    work = Workload(_tiny_params(),
                    dtype="fp32", optimizer="adamw")
    return plan(work, Links(2, 2), strategy=strategy).chosen.device / 1024**3


def _tiny_params() -> int:
    import torch

    from shardwise.models.gpt import GPT, GPTConfig

    with torch.device("meta"):
        return GPT(GPTConfig.preset("tiny")).num_parameters()


def test_auto_picks_a_strategy_that_fits_and_says_why(corpus_file, tmp_path, capsys):
    # Memory per rank between ZeRO-3's and DDP's estimates: DDP cannot be chosen, a sharded strategy must be.
    budget = (_states_gb("zero3") + _states_gb("ddp")) / 2 / 0.9
    assert main(["demo", *FAST, "--steps", "2", "--data", corpus_file, "--out", str(tmp_path),
                 "--strategy", "auto", "--memory-gb", repr(budget)]) == 0
    out = capsys.readouterr().out
    assert "--strategy auto: the planner chose " in out and "Chosen: " in out
    chosen = out.split("the planner chose ")[1].split()[0]
    assert chosen != "ddp" and f"{chosen:<20}" in out  # the candidates' table names it
    summary = json.loads(next(tmp_path.rglob("summary.json")).read_text())
    assert summary["options"]["strategy"] == chosen
    # With room for everything, the planner keeps the simplest: DDP.
    assert DemoOptions(strategy="auto", preset="tiny", nproc=2, memory_gb=64.0).strategy == "ddp"


def test_progress_off_a_terminal_prints_whole_lines_not_carriage_returns():
    import io

    from shardwise.demo.progress import LineProgress, progress_bar

    out = io.StringIO()  # not a terminal: a log file, a pipe
    bar = progress_bar(20, "zero3", out=out)
    assert isinstance(bar, LineProgress)
    for step in range(20):
        bar.set_postfix(loss=f"{5 - step * 0.1:.3f}")
        bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) == 10, lines  # every tenth of the run, the last one included
    assert lines[-1] == "zero3: 20/20 steps loss=3.100", lines
