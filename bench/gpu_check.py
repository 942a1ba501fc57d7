"""The GPU check (`make gpu-check`): everything shardwise can learn from a GPU machine lent for ~15 minutes, in one
command that installs nothing and needs no network, with one report to carry back.

It runs with the Python it is started by (`make gpu-check PYTHON=python3`: on a GPU machine, the system Python that
already has a CUDA build of torch), with shardwise from `src/` (PYTHONPATH), and never calls pip or creates a venv.
Stages, each a subprocess under its own time limit (8 minutes in all by default), in this order (the figures
first, then the tests, which may find a hang that costs their whole limit):

  env      torch and CUDA versions, device name and capability, NCCL version (in-process, seconds)
  bench    bench/gpu.py: GPT-2 small in bf16, tokens/s, MFU and peak memory of plain PyTorch, shardwise ZeRO-3 and
           DDP and PyTorch FSDP2, alternating in one process, with the ZeRO-3 / plain and ZeRO-3 / FSDP2 ratios
  compile  bench/gpu.py --compile on plain PyTorch and ZeRO-3 (torch.compile of the whole model)
  profile  bench/gpu.py --profile: 3 profiled steps of plain, ZeRO-3 and FSDP2 (host vs device time, operators)
           into profile/profile-<row>.txt, to see where a gap to plain PyTorch goes
  tests    pytest -m gpu on tests/test_gpu.py and tests/test_gpu_matrix.py: the CUDA paths (NCCL in a world of one,
           streams, offload, bf16 / fp16, checkpoints, torch.compile) and the parity matrix on thread ranks holding
           CUDA tensors (DDP, ZeRO-1/2/3, FSDP, TP, SP, pipelines, 3-D, sw.distribute, compression, local SGD);
           each test at most SHARDWISE_TEST_LIMIT s (gpu_check_plugin.py: stacks dumped, then TimeoutError)

Without CUDA it says so in one line, runs the CPU dry run of bench/gpu.py (`--device cpu --preset tiny`, the logic
without the figures) and exits 0: tests/test_gpu_check.py runs exactly that in `make test`, so the script cannot
rot between GPU sessions. The report folder (--out, `GPU_CHECK_OUT=` in make; default runs/gpu-check-<time>/) gets
report.md and report.json, plus each stage's log; the summary table is printed last.

    make gpu-check PYTHON=python3 GPU_CHECK_OUT=/tmp/gpu                 # on the GPU machine
    PYTHONPATH=src python3 bench/gpu_check.py --stages tests --out /tmp/gpu   # rerun one stage
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from shardwise.benchmarks.timing import loadavg

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("bench", "compile", "tests", "profile")
#: Seconds each stage may run (the defaults sum to 8 minutes: the check must leave a 15-minute lease room for a
#: machine start and one rerun of a stage).
LIMITS = {"tests": 190, "bench": 150, "compile": 80, "profile": 60, "dry_run": 150}
GPU_TESTS = ("tests/test_gpu.py", "tests/test_gpu_matrix.py")


def environment() -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                           "cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
                           "host_cores": os.cpu_count()}
    if env["cuda_available"]:
        env["device"] = torch.cuda.get_device_name(0)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        env["device_count"] = torch.cuda.device_count()
        env["memory_GB"] = round(torch.cuda.get_device_properties(0).total_memory / 1024**3, 1)
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as exc:  # noqa: BLE001 - a build without NCCL is a finding, not a crash
            env["nccl"] = f"unavailable ({type(exc).__name__}: {exc})"
    for name in ("pytest", "transformers", "safetensors"):
        try:
            env[name] = __import__(name).__version__
        except ImportError:
            env[name] = None
    return env


def run_stage(name: str, argv: list[str], out: Path, limit: float) -> dict[str, Any]:
    """`argv` under `limit` seconds in its own process group (killed whole on timeout), stdout and stderr to
    out/<name>.out and out/<name>.log; returns rc, seconds and timed_out."""
    path = [str(ROOT / "src"), str(ROOT / "bench"), os.environ.get("PYTHONPATH")]  # bench: gpu_check_plugin
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path)),
           "PIP_NO_INDEX": "1"}  # belt and braces: nothing below may install anything
    t0 = time.monotonic()
    with open(out / f"{name}.out", "w") as so, open(out / f"{name}.log", "w") as se:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=so, stderr=se, env=env, start_new_session=True)
        try:
            rc, timed_out = proc.wait(timeout=limit), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc, timed_out = proc.wait(), True
    result = {"rc": rc, "seconds": round(time.monotonic() - t0, 1), "timed_out": timed_out, "limit_s": limit,
              "command": " ".join(argv[1:])}
    print(f"[gpu-check] {name}: rc {rc}{' (timed out)' if timed_out else ''} in {result['seconds']} s", flush=True)
    return result


def parse_junit(path: Path) -> dict[str, Any]:
    """Counts and the failed tests' names from pytest's JUnit XML."""
    if not path.exists():
        return {}
    root = ET.parse(path).getroot()
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed = []
    for suite in root.iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname')}::{case.get('name')}")
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "failed": failed}


def parse_bench(path: Path) -> dict[str, Any]:
    """bench/gpu.py's JSON lines: rows by name, the parity line and the ratios line."""
    rows, extra = {}, {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "name" in rec:
                rows[rec["name"]] = rec
            else:
                extra.update(rec)
    return {"rows": rows, "ratios": extra.get("ratios", {}), "parity": extra.get("parity_max_rel_diff_vs_plain")}


def stage_commands(py: str, out: Path, cuda: bool) -> dict[str, list[str]]:
    if not cuda:
        return {"dry_run": [py, "bench/gpu.py", "--device", "cpu", "--preset", "tiny", "--steps", "2", "--rounds",
                            "2", "--warmup", "1"]}
    return {
        "tests": [py, "-m", "pytest", "-v", "--tb=short", "-m", "gpu", "-rfEs", "-o", "addopts=", "-p",
                  "no:cacheprovider", "-p", "gpu_check_plugin", f"--junitxml={out / 'tests.xml'}", *GPU_TESTS],
        "bench": [py, "bench/gpu.py"],
        "compile": [py, "bench/gpu.py", "--impls", "plain,sw_zero3", "--compile", "--warmup", "3", "--rounds", "3"],
        "profile": [py, "bench/gpu.py", "--impls", "plain,sw_zero3,fsdp2", "--rounds", "1", "--steps", "3",
                    "--profile", str(out / "profile")],
    }


def markdown(report: dict[str, Any]) -> str:
    env = report["env"]
    lines = [f"# GPU check, {report['started']}", "",
             f"{env.get('device', 'no CUDA device')} (capability {env.get('capability', '-')}, "
             f"{env.get('memory_GB', '-')} GB), torch {env['torch']} (CUDA {env['cuda_build']}), NCCL "
             f"{env.get('nccl', '-')}, Python {env['python']}, {env['host_cores']} host cores; load average "
             f"{report['loadavg']}", "", "| stage | rc | seconds | result |", "|---|---|---|---|"]
    for name, st in report["stages"].items():
        lines.append(f"| {name} | {st['rc']}{' (timed out)' if st['timed_out'] else ''} | {st['seconds']} | "
                     f"{st.get('result', '')} |")
    for name in ("bench", "compile", "dry_run"):
        st = report["stages"].get(name)
        if not st or not st.get("rows"):
            continue
        lines += ["", f"## {name}: {st['command']}", "", "| row | median ms | tokens/s | MFU | peak GB |",
                  "|---|---|---|---|---|"]
        for r in st["rows"].values():
            mfu = "-" if r.get("mfu") is None else f"{r['mfu']:.1%}"
            lines.append(f"| {r['name']} | {r['median_ms']:.1f} | {r['tokens_per_s']:.0f} | {mfu} | "
                         f"{r.get('peak_alloc_GB', '-')} |")
        for key, e in st["ratios"].items():
            lines.append(f"\n{key} = {e['ratio']} (paired per round {e['paired_per_round_median']}; goal {e['goal']}:"
                         f" {'met' if e['meets_goal'] else 'NOT met'})")
        if st.get("parity"):
            lines.append(f"\nparity vs plain (max|diff| / max|param|): {st['parity']}")
    failed = report["stages"].get("tests", {}).get("failed") or []
    if failed:
        lines += ["", "## failed tests", ""] + [f"- {t}" for t in failed]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="report folder (default runs/gpu-check-<time>/)")
    ap.add_argument("--stages", default=",".join(STAGES), help=f"comma list of {STAGES} (with CUDA)")
    ap.add_argument("--limit", action="append", default=[], metavar="STAGE=SECONDS",
                    help=f"override a stage's time limit (defaults {LIMITS})")
    args = ap.parse_args(argv)
    limits = dict(LIMITS)
    for item in args.limit:
        name, _, value = item.partition("=")
        if name not in limits or not value.replace(".", "", 1).isdigit():
            ap.error(f"--limit {item!r}: expected STAGE=SECONDS with STAGE in {list(limits)}")
        limits[name] = float(value)
    stages = [s for s in args.stages.split(",") if s]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        ap.error(f"--stages: unknown {bad}; allowed {STAGES}")
    started = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    out = Path(args.out or ROOT / "runs" / f"gpu-check-{datetime.datetime.now():%Y%m%d-%H%M%S}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    cuda = bool(env["cuda_available"])
    if cuda:
        print(f"[gpu-check] {env['device']}, torch {env['torch']}, CUDA {env['cuda_build']}, NCCL {env['nccl']}",
              flush=True)
    else:
        print(f"[gpu-check] no CUDA device here (torch {env['torch']}): running the CPU dry run only", flush=True)
    commands = stage_commands(sys.executable, out, cuda)
    if cuda:
        commands = {k: commands[k] for k in stages}
    report: dict[str, Any] = {"started": started, "env": env, "loadavg": loadavg(), "stages": {}}
    for name, cmd in commands.items():
        st = run_stage(name, cmd, out, limits[name])
        if name == "tests":
            st.update(parse_junit(out / "tests.xml"))
            st["result"] = (f"{st.get('passed', 0)} passed, {st.get('failures', 0) + st.get('errors', 0)} failed, "
                            f"{st.get('skipped', 0)} skipped")
        else:
            st.update(parse_bench(out / f"{name}.out"))
            st["result"] = f"{len(st['rows'])} rows" + (f", parity {st['parity']}" if st["parity"] else "")
        report["stages"][name] = st
        (out / "report.json").write_text(json.dumps(report, indent=1, default=str))  # kept if a later stage hangs
    report["loadavg_end"] = loadavg()
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    text = markdown(report)
    (out / "report.md").write_text(text)
    print(f"\n[gpu-check] report: {out}/report.md\n\n{text}", flush=True)
    return 0 if all(st["rc"] == 0 for st in report["stages"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
