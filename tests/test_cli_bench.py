"""`shardwise bench`: the harness runs from the package on 2 gloo ranks with a tiny model, writes its table, JSON
lines and plots with every row, shows a missing peer with its install line, and puts measured figures beside
their formulas; bad options are usage errors before torch work starts."""

from __future__ import annotations

import json

import pytest

import shardwise_cli
from shardwise.benchmarks import ORDER, PEERS, BenchConfig, suite
from shardwise_cli import main

ROWS = ("local", "sw_ddp", "torch_ddp", "sw_zero3", "fsdp2", "ds_zero3")
TINY = ["--preset", "tiny", "--batch-size", "2", "--rounds", "1", "--steps", "1"]


def test_the_command_line_offers_the_package_rows():
    assert shardwise_cli.BENCH_ROWS == ORDER


@pytest.mark.parametrize("argv, needle", [
    (["--impls", "sw_ddp,zero9"], "argument --impls: 'sw_ddp,zero9' names ['zero9']; allowed (comma list): local"),
    (["--impls", "sw_ddp,sw_ddp"], "names a row twice"),
    (["--nproc", "0"], "argument --nproc: 0 must be >= 1"),
    (["--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
])
def test_bad_options_are_usage_errors(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", *argv])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_an_out_that_holds_files_is_refused(tmp_path, capsys):
    (tmp_path / "old.txt").write_text("keep me")
    assert main(["bench", *TINY, "--out", str(tmp_path)]) == 1
    assert "cannot write the run directory" in capsys.readouterr().err
    assert (tmp_path / "old.txt").read_text() == "keep me"


def test_bad_config_values_are_named():
    with pytest.raises(ValueError, match=r"bench: impls=\['nope'\] must be a non-empty list of"):
        BenchConfig(impls=("nope",))
    with pytest.raises(ValueError, match=r"bench: warmup=0 must be an int >= 1"):
        BenchConfig(warmup=0)


def test_torch_peers_are_refused_on_a_communicator_without_a_torch_group():
    from shardwise.comm import ThreadWorld
    from shardwise.comm.torch_peers import torch_process_group

    comm = ThreadWorld(1).communicators()[0]
    with pytest.raises(ValueError, match=r"torch's own DDP/FSDP2 need a torch.distributed communicator .* got Thread"):
        torch_process_group(comm)


@pytest.mark.multiprocess
def test_bench_writes_table_and_plots_with_every_row(tmp_path, capsys, monkeypatch):
    found = suite.missing
    # DeepSpeed may or may not be installed here: make its row missing, so the install line is always checked.
    monkeypatch.setattr(suite, "missing", lambda name: "deepspeed is not installed" if name.startswith("ds_")
                        else found(name))
    out = tmp_path / "bench-run"
    assert main(["bench", *TINY, "--impls", ",".join(ROWS), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "ds_zero3: not run (deepspeed is not installed; install: DS_BUILD_OPS=0 pip install deepspeed)" in printed

    table = (out / "results.md").read_text()
    lines = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    assert set(ROWS) <= set(lines)
    assert "not run: deepspeed is not installed; install: `DS_BUILD_OPS=0 pip install deepspeed`" in lines["ds_zero3"]
    assert "## Not run" in table
    for plot in ("step_time.png", "memory.png", "bytes.png"):
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", plot

    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    header, rows = records[0]["run"], {r["row"]: r for r in records[1:]}
    assert list(rows) == list(ROWS)
    assert rows["ds_zero3"]["status"] == "missing" and rows["ds_zero3"]["install"] == PEERS["ds_zero3"].install
    ran = [rows[name] for name in ROWS if name != "ds_zero3"]
    assert all(r["status"] == "ok" and r["median_ms"] > 0 and r["steps"] == 1 for r in ran)
    # Bytes: DDP's all-reduce is its formula exactly on 2 ranks; ZeRO-3 keeps the root and last units gathered into
    # backward, so it is under 3(N-1)/N x G but above DDP's 2(N-1)/N x G; the floor sends nothing.
    assert rows["sw_ddp"]["wire_bytes"] == rows["sw_ddp"]["formula_wire_bytes"] == header["grad_bytes"]
    assert rows["sw_ddp"]["formula_wire_bytes"] < rows["sw_zero3"]["wire_bytes"] <= rows["sw_zero3"]["formula_wire_bytes"]
    assert rows["local"]["wire_bytes"] == 0
    assert rows["torch_ddp"]["wire_bytes_source"] == "formula"
    # Memory: every row's model states (read right after an optimizer step) within 5% of the ZeRO estimate, fp32
    # AdamW: 16 bytes per parameter unsharded, 16/N under ZeRO-3 and FSDP2.
    for name in ("local", "sw_ddp", "torch_ddp", "sw_zero3", "fsdp2"):
        assert rows[name]["model_states"] == pytest.approx(rows[name]["estimate_model_states"], rel=0.05), name
    assert rows["sw_zero3"]["estimate_model_states"] == pytest.approx(rows["sw_ddp"]["estimate_model_states"] / 2)
    # Same init, same batches: the distributed rows end at the same loss (the floor trains on half the batch).
    assert rows["sw_ddp"]["loss"] == pytest.approx(rows["torch_ddp"]["loss"], rel=1e-4)
    assert rows["sw_zero3"]["loss"] == pytest.approx(rows["fsdp2"]["loss"], rel=1e-4)
    # The floor is checked (fastest, or why not) and the load recorded, in the table and on the terminal.
    assert header["floor_check"].startswith("Floor: ") and header["floor_check"] in table
    assert header["floor_check"] in printed and "load average before" in printed


def _row(name: str, strategy: str, median: float, spread: float = 1.0, library: str = "shardwise") -> dict:
    return {"row": name, "label": name, "library": library, "strategy": strategy, "status": "ok", "reason": None,
            "install": None, "formula": "f", "formula_wire_bytes": 1 << 20, "estimate_model_states": 1 << 20,
            "median_ms": median, "p10_ms": median - spread, "p90_ms": median + spread, "steps": 3,
            "tokens_per_s": 1, "loss": 1.0, "wire_bytes": 1 << 20, "wire_bytes_source": "measured", "ops": {},
            "vs_floor": None, "model_states": 1 << 20, "peak_rss_delta": 1 << 20}


def test_the_floor_check_says_why_a_row_beats_the_floor():
    from shardwise.benchmarks.report import floor_check

    floor = _row("local", "none", 100.0, library="torch")
    assert "is the fastest" in floor_check([floor, _row("sw_ddp", "ddp", 120.0)])
    noisy = floor_check([floor, _row("sw_ddp", "ddp", 99.0, spread=5.0)])
    assert "not the fastest" in noisy and "sw_ddp (99.0 ms, 1% under it) is within this run's noise" in noisy
    sharded = floor_check([floor, _row("sw_zero3", "zero3", 80.0)])
    assert "sw_zero3 (80.0 ms, 20% under it) shards the optimizer step" in sharded
    suspect = floor_check([floor, _row("sw_ddp", "ddp", 80.0)])
    assert "no mechanism that explains it: do not trust this run's figures" in suspect
    assert "did not run" in floor_check([_row("sw_ddp", "ddp", 80.0)])


def test_every_plot_has_a_legend_and_units(tmp_path, monkeypatch):
    from shardwise.benchmarks import report

    drawn = {}

    def capture(fig, path, dpi):
        (ax,) = fig.axes
        drawn[path.name] = (ax.get_legend() is not None, ax.get_xlabel(), ax.get_ylabel())

    monkeypatch.setattr(report, "save_figure", capture)
    rows = [_row("local", "none", 100.0, library="torch"), _row("sw_ddp", "ddp", 120.0),
            _row("torch_ddp", "ddp", 118.0, library="torch"), _row("ds_zero3", "zero3", 130.0, library="deepspeed")]
    header = {"config": {"preset": "tiny", "nproc": 2, "batch_size": 2, "lr": 1e-3, "warmup": 1, "rounds": 1,
                         "steps": 1, "memory_steps": 1}, "num_params": 1000, "seq_len": 8, "tokens_per_step": 32,
              "torch": "x", "python": "x", "cpus": 2, "loadavg_before": [9.0, 1, 1], "loadavg_after": [1, 1, 1],
              "wall_s": 1, "started": "now", "floor_check": report.floor_check(rows),
              "load_warning": "warning: the load average 9.00 exceeds the 2 usable cores"}
    report.write_report(report.BenchResult(tmp_path, rows, header))
    assert set(drawn) == set(report.PLOTS)
    for name, (legend, xlabel, ylabel) in drawn.items():
        assert legend and xlabel, name
        assert any(unit in ylabel for unit in ("ms", "MiB")), (name, ylabel)
    text = (tmp_path / "results.md").read_text()
    assert "Floor: the no-communication row is the fastest (100.0 ms)" in text
    assert "**Warning: the load average 9.00 exceeds the 2 usable cores.**" in text
