"""`shardwise bench`: the harness runs from the package on 2 gloo ranks with a tiny model, writes its table, JSON
lines and plots with every row, shows a missing peer with its install line, and puts measured figures beside
their formulas; bad options are usage errors before torch work starts."""

from __future__ import annotations

import json

import pytest

import shardwise_cli
from shardwise.benchmarks import ORDER, PEERS, BenchConfig, suite
from shardwise.cli import main

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
