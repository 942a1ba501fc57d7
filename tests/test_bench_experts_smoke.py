"""bench/experts.py's smoke run (`--quick`: a one-layer MoE GPT of width 32 on 2 and 4 thread ranks, a few steps).

What it checks without timing anything: every row prints, the all-to-all bytes the communicator counted equal the
formula of docs/experts.md (recomputed here from the printed sizes, not taken from the script's own ratio), the
capacity factor drops assignments and the dropless row none, and dropless expert parallel trains as one process.
The step times are not asserted (a shared 2-core machine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "experts.py"


@pytest.mark.timeout(120)
def test_quick_run_counts_the_formula_bytes_and_drops_only_with_a_capacity_factor():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--ep", "2,4", "--capacity-factor", "1.0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines()]  # stdout is JSON lines only
    cfg = lines[0]["config"]
    E, d, k, layers = cfg["n_experts"], cfg["d_model"], cfg["top_k"], cfg["n_layers"]
    for ep in (2, 4):
        rows = {r["name"] for r in lines if "name" in r and r["ep"] == ep}
        assert rows == {"dropless", "cf1", "one_process", "no_comm_floor"}
        counted = {r["bytes"]: r for r in lines if "bytes" in r and r["ep"] == ep}
        assert set(counted) == {"dropless", "cf1"}
        tokens = ep * cfg["batch_size"] * cfg["seq_len"]
        assert all(r["tokens_per_step"] == tokens for r in counted.values())
        for name, r in counted.items():
            steps = r["steps_counted"]
            assert steps == cfg["rounds"] * cfg["steps"]
            # per layer and step: ep ranks x E int64 counts, and 4 all-to-alls of the kept assignments' rows (fp32)
            want = steps * layers * ep * 8 * E + 4 * 4 * d * (steps * layers * tokens * k - r["dropped_total"])
            assert r["all_to_all_bytes_total"] == want, (ep, name, r)
            assert r["every_step_exact"] and r["ratio"] == 1.0
        assert counted["dropless"]["dropped_total"] == 0
        assert counted["cf1"]["dropped_total"] > 0
        parity = next(r for r in lines if "parity" in r and r["ep"] == ep)
        assert parity["max_abs_diff"] < 1e-5
