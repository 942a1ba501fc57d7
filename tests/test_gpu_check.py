"""`make gpu-check` without a GPU (issue 31): it says there is no CUDA device, runs bench/gpu.py's CPU dry run,
writes report.md and report.json, creates no venv, installs nothing, and exits 0, so the script a lent GPU machine
runs cannot rot between GPU sessions.

It runs from a scratch folder holding links to src/ and bench/ and a copy of the Makefile (a .venv appearing there
would be the target's doing), with `pip` and `pip3` on PATH replaced by scripts that record any call and fail."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def scratch(tmp_path):
    work = tmp_path / "repo"
    work.mkdir()
    for name in ("src", "bench", "tests"):
        (work / name).symlink_to(ROOT / name)
    shutil.copy(ROOT / "Makefile", work / "Makefile")
    fake = tmp_path / "fakebin"
    fake.mkdir()
    for tool in ("pip", "pip3"):
        script = fake / tool
        script.write_text(f"#!/bin/sh\necho \"$0 $*\" >> {tmp_path / 'pip-called'}\nexit 1\n")
        script.chmod(0o755)
    return work, fake, tmp_path


@pytest.mark.multiprocess  # make, then bench/gpu_check.py and its dry run: interpreters importing torch
@pytest.mark.timeout(170)
def test_make_gpu_check_without_cuda_runs_the_dry_run_and_installs_nothing(scratch):
    work, fake, tmp = scratch
    out = tmp / "report"
    env = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"}
    make = ["make", "--no-print-directory"]
    args = ["gpu-check", f"PYTHON={sys.executable}", f"GPU_CHECK_OUT={out}"]
    dry = subprocess.run([*make, "-n", *args], cwd=work, capture_output=True, text=True, env=env, timeout=30)
    assert dry.returncode == 0, dry.stderr
    assert "pip" not in dry.stdout and "venv" not in dry.stdout.replace(".venv/bin/python", ""), dry.stdout
    proc = subprocess.run([*make, *args], cwd=work, capture_output=True, text=True, env=env, timeout=160)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "no CUDA device here" in proc.stdout
    assert not (work / ".venv").exists()
    assert not (tmp / "pip-called").exists(), (tmp / "pip-called").read_text()
    report = json.loads((out / "report.json").read_text())
    assert report["env"]["cuda_available"] is False
    dry_run = report["stages"]["dry_run"]
    assert dry_run["rc"] == 0 and not dry_run["timed_out"]
    assert set(dry_run["rows"]) == {"plain", "sw_zero3", "sw_ddp", "fsdp2"}
    assert all(v == 0.0 for v in dry_run["parity"].values()), dry_run["parity"]  # same maths on CPU, bit for bit
    text = (out / "report.md").read_text()
    assert "| dry_run | 0 |" in text and "sw_zero3/plain_tokens_per_s" in text
    assert proc.stdout.rstrip().endswith(text.rstrip())  # the summary is printed last


def test_gpu_check_refuses_unknown_stages_and_limits(capsys):
    """Its main() in this process (an interpreter per case would cost seconds of `import torch` each; the test above
    runs the script itself): exit status 2 and the reason on stderr, before any stage runs."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    for args, words in ((["--stages", "bench,nope"], "unknown ['nope']"), (["--limit", "tests=soon"], "STAGE=SECONDS")):
        with pytest.raises(SystemExit) as info:
            gpu_check.main(args)
        stderr = capsys.readouterr().err
        assert info.value.code == 2 and words in stderr, stderr
