"""`shardwise run --max-restarts R` (launch/restarts.py): an elastic job replaces a crashed worker by a fresh process
that joins the running job, and still ends with the parameters of one process trained on the same global batches;
with R = 0 it goes on with the survivor; a fixed-size job restarts every worker (torchrun's semantics) at most R
times, then fails with the blame report. Tiny scripts (a linear model, a few all-reduces): seconds, not minutes."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import shardwise as sw
from shardwise.launch.restarts import RestartBudget
from shardwise.launch.supervise import RunConfig, keep_survivors, run, tear_down
from shardwise_cli import main

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[1]
N, G, STEPS, CRASH_STEP = 48, 12, 6, 2

# An elastic worker: sw.elastic.run over a linear model with DDP. Launch rank 1 SIGKILLs itself at step CRASH_STEP the
# first time (the marker file says whether it did already): a restarted process at launch rank 1 trains on.
ELASTIC = f"""
    import json, os, signal, sys, time
    import torch
    import shardwise as sw

    out, expect_rejoin = sys.argv[1], sys.argv[2] == "1"
    X = torch.randn({N}, 4, generator=torch.Generator().manual_seed(0))
    Y = torch.randn({N}, 2, generator=torch.Generator().manual_seed(1))
    membership = sw.elastic.Membership.from_env(timeout=4.0, silence=1.0, wait_timeout=30.0)
    marker = os.path.join(out, "crashed")

    def build(comm):
        torch.manual_seed(0)
        model = sw.DDP(torch.nn.Linear(4, 2), comm)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def train_step(ctx):
        if os.environ["RANK"] == "1" and ctx.step == {CRASH_STEP} and not os.path.exists(marker):
            open(marker, "w").write(os.environ["TORCHELASTIC_RESTART_COUNT"])
            os.kill(os.getpid(), signal.SIGKILL)
        if expect_rejoin and ctx.comm.size == 1:
            # The survivor alone waits (at most 60 s) until the restarted worker asks to join, so that the run goes
            # 2 -> 1 -> 2 however slowly the new process starts; the loop's next poll takes it in.
            deadline = time.monotonic() + 60
            while not membership.poll() and time.monotonic() < deadline:
                time.sleep(0.05)
        idx = ctx.sampler.rank_indices()
        loss = torch.nn.functional.mse_loss(ctx.model(X[idx]), Y[idx])
        loss.backward()
        ctx.optimizer.step()
        ctx.optimizer.zero_grad()
        return loss.item()

    sampler = sw.elastic.Sampler({N}, global_batch={G}, seed=1, world_sizes=range(1, 3))
    ctx = sw.elastic.run(membership, build, train_step, sampler=sampler, steps={STEPS})
    state = sw.full_state_dict(ctx.model)
    if ctx.comm.rank == 0:
        torch.save(state, os.path.join(out, "final.pt"))
    with open(os.path.join(out, f"member-{{membership.id}}.json"), "w") as f:
        json.dump({{"world": ctx.comm.size, "step": ctx.step, "restart": os.environ["TORCHELASTIC_RESTART_COUNT"],
                   "sources": [e["source"] for e in ctx.timeline if "epoch" in e]}}, f)
    membership.close()
"""

# A fixed-size job: two all-reduces; rank 1 fails between them the first time (MODE=once) or every time (always).
FIXED = """
    import os, sys, torch
    import shardwise as sw

    out, mode = sys.argv[1], sys.argv[2]
    comm = sw.init()
    t = torch.ones(1)
    comm.all_reduce(t)
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    if comm.rank == 1 and (mode == "always" or not os.path.exists(os.path.join(out, "crashed"))):
        open(os.path.join(out, "crashed"), "w").close()
        raise RuntimeError(f"rank 1 crashed in attempt {attempt}")
    comm.all_reduce(t)
    # one write per line: both ranks share the supervisor's stdout
    sys.stdout.write(f"rank {comm.rank} finished attempt {attempt} of {os.environ['TORCHELASTIC_MAX_RESTARTS']}: "
                     f"{t.item():g}\\n")
"""


def _script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def _shardwise(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "shardwise", "run", *argv], capture_output=True, text=True,
                          timeout=100, cwd=ROOT, env=env)


def _reference() -> dict[str, torch.Tensor]:
    """One process, the same model, optimizer and global batches in the same order, never interrupted."""
    x = torch.randn(N, 4, generator=torch.Generator().manual_seed(0))
    y = torch.randn(N, 2, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    sampler = sw.elastic.Sampler(N, global_batch=G, seed=1)
    for _ in range(STEPS):
        idx = sampler.global_batch_indices()
        torch.nn.functional.mse_loss(net(x[idx]), y[idx]).backward()
        opt.step()
        opt.zero_grad()
        sampler.advance()
    return net.state_dict()


def _assert_reference(tmp_path: Path) -> None:
    got = torch.load(tmp_path / "final.pt", weights_only=True)
    for name, want in _reference().items():
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_elastic_worker_that_crashes_is_restarted_and_joins_the_running_job(tmp_path):
    script = _script(tmp_path, "elastic.py", ELASTIC)
    result = _shardwise("--min", "1", "--max", "2", "-n", "2", "--max-restarts", "1", "--timeout", "10", script,
                        str(tmp_path), "1")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "shardwise run: rank 1 killed by SIGKILL; restarting it to join the running job (restart 1 of 1, 0 left)" \
        in out, out
    assert "shardwise run: 1 of --max-restarts 1 restart(s) used: restart 1: rank 1 after killed by SIGKILL" in out
    assert "add workers with SHARDWISE_JOB_TOKEN=" in out and "shardwise run --join --min 1 --max 2" in out, out
    members = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("member-*.json"))]
    assert len(members) == 2 and all(m["world"] == 2 and m["step"] == STEPS for m in members), members
    survivor = next(m for m in members if m["restart"] == "0")
    restarted = next(m for m in members if m["restart"] == "1")
    assert survivor["sources"][0] == "new" and survivor["sources"][-1] == "survivors", survivor
    assert restarted["sources"] == ["joined"], restarted  # a newcomer: the survivor's state, no checkpoint
    _assert_reference(tmp_path)


# The tests below call the supervisor in this process (what the CLI calls, without starting one more interpreter):
# its own lines go to `out`, the ranks write to this process's stdout / stderr (capfd).
def _run(script: str, *args: str, **options) -> tuple[object, str]:
    lines = io.StringIO()
    result = run(RunConfig(script, args, nproc=2, grace=1.0, **options),
                 keep_survivors if options.get("elastic") else tear_down, out=lines)
    return result, lines.getvalue() + result.report()


def test_elastic_job_without_restarts_goes_on_with_the_survivor(tmp_path, capfd):
    script = _script(tmp_path, "elastic.py", ELASTIC)
    result, out = _run(script, str(tmp_path), "0", elastic=(1, 2), timeout=10.0)
    assert result.exit_code == 128 + 9, out + capfd.readouterr().err  # the job still names the worker it lost
    assert "shardwise run: rank 1 failed first: killed by SIGKILL" in out and "restarting" not in out, out
    members = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("member-*.json"))]
    assert len(members) == 1 and members[0]["world"] == 1 and members[0]["step"] == STEPS, members
    _assert_reference(tmp_path)


def test_a_replacement_that_comes_after_the_job_finished_does_not_fail_it(tmp_path, capfd):
    """The survivor does not wait for the restarted worker: it usually finishes first, and the replacement, finding
    nothing left to join (MembershipError), counts as done; if it is quicker, it joins. Either way: exit 0, the
    parameters of one process."""
    script = _script(tmp_path, "elastic.py", ELASTIC)
    result, out = _run(script, str(tmp_path), "0", elastic=(1, 2), timeout=10.0, max_restarts=1)
    assert result.exit_code == 0, out + capfd.readouterr().err
    assert "restarting it to join the running job (restart 1 of 1, 0 left)" in out, out
    late = "rank 1's replacement ended (raised MembershipError: elastic: the job finished before worker" in out
    members = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("member-*.json"))]
    assert [m["world"] for m in members] == ([1] if late else [2, 2]), (out, members)
    _assert_reference(tmp_path)


def test_fixed_size_job_restarts_every_worker_once_and_finishes(tmp_path, capfd):
    script = _script(tmp_path, "fixed.py", FIXED)
    result, out = _run(script, str(tmp_path), "once", max_restarts=2)
    printed = capfd.readouterr().out
    assert result.exit_code == 0, out
    assert ("shardwise run: rank 1 failed (RuntimeError: rank 1 crashed in attempt 0); restarting all 2 rank(s) "
            "(restart 1 of 2, 1 left)") in out, out
    # both ranks of the second attempt finished (two all-reduces of ones over 2 ranks: 4), none of the first did
    assert sorted(re.findall(r"rank \d finished attempt \d of \d: \d+", printed)) == [
        "rank 0 finished attempt 1 of 2: 4", "rank 1 finished attempt 1 of 2: 4"], out


def test_fixed_size_job_that_always_crashes_fails_after_its_restarts_with_the_blame_report(tmp_path, capfd):
    script = _script(tmp_path, "fixed.py", FIXED)
    result, out = _run(script, str(tmp_path), "always", max_restarts=1)
    assert result.exit_code == 1, out
    assert "restarting all 2 rank(s) (restart 1 of 1, 0 left)" in out, out
    assert ("shardwise run: rank 1 failed (RuntimeError: rank 1 crashed in attempt 1); no restart left (1 of "
            "--max-restarts 1 used)") in out, out
    report = out[out.index("shardwise run: rank 1 failed first"):]
    assert report.startswith("shardwise run: rank 1 failed first: RuntimeError: rank 1 crashed in attempt 1"), report
    assert 'raise RuntimeError(f"rank 1 crashed in attempt {attempt}")' in report  # the traceback of the last attempt
    assert "1 of --max-restarts 1 restart(s) used: restart 1: all ranks after rank 1: RuntimeError" in report
    assert "finished" not in capfd.readouterr().out


def test_fixed_size_job_under_mpirun_restarts_mpirun(tmp_path, capfd):
    """--backend mpi: MPI aborts the whole job when rank 1 raises; the restart starts mpirun again, and the finished
    run reports nothing but its restart (no rank is "stopped" when mpirun itself ended them)."""
    script = _script(tmp_path, "fixed.py", FIXED)
    result, out = _run(script, str(tmp_path), "once", max_restarts=1, backend="mpi")
    printed = capfd.readouterr().out
    assert result.exit_code == 0, out
    assert "restarting all 2 rank(s) (restart 1 of 1, 0 left)" in out and "stopped rank(s)" not in out, out
    assert sorted(re.findall(r"rank \d finished attempt \d of \d: \d+", printed)) == [
        "rank 0 finished attempt 1 of 1: 4", "rank 1 finished attempt 1 of 1: 4"], out


def test_the_budget_is_job_wide_and_says_what_is_left():
    """Pure logic: restarts are counted over the whole job, whichever rank crashes (torchrun's rule); each decision is
    one line; R = 0 says nothing (the behaviour without the option)."""
    lines = io.StringIO()
    budget = RestartBudget(2, lines)
    assert budget.take_worker(3, "killed by SIGKILL").number == 1
    assert budget.take_worker(1, "exited with code 3").number == 2 and budget.left == 0
    assert budget.take_worker(3, "killed by SIGKILL") is None and budget.left == 0
    assert budget.take_group(0, "RuntimeError: x", 4) is None
    assert [r.describe() for r in budget.history] == ["restart 1: rank 3 after killed by SIGKILL",
                                                      "restart 2: rank 1 after exited with code 3"]
    assert lines.getvalue().splitlines() == [
        "shardwise run: rank 3 killed by SIGKILL; restarting it to join the running job (restart 1 of 2, 1 left)",
        "shardwise run: rank 1 exited with code 3; restarting it to join the running job (restart 2 of 2, 0 left)",
        "shardwise run: rank 3 killed by SIGKILL; no restart left (2 of --max-restarts 2 used): the job goes on "
        "without it",
        "shardwise run: rank 0 failed (RuntimeError: x); no restart left (2 of --max-restarts 2 used)"]
    silent = io.StringIO()
    assert RestartBudget(0, silent).take_worker(0, "killed by SIGKILL") is None and silent.getvalue() == ""


def test_bad_restart_options_are_named(tmp_path, capsys):
    script = _script(tmp_path, "fixed.py", FIXED)
    with pytest.raises(ValueError, match=r"max_restarts=-1 must be an int >= 0"):
        RunConfig(script, max_restarts=-1)
    with pytest.raises(ValueError, match=r"max_restarts=2 with nnodes=2: restarting a fixed-size group that spans"):
        RunConfig(script, nnodes=2, master_port=29500, max_restarts=2)
    with pytest.raises(ValueError, match=r"max_restarts=-1 must be an int >= 0"):
        RestartBudget(-1)
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--max-restarts", "-1", script])
    assert exit_info.value.code == 2 and "argument --max-restarts: -1 must be >= 0" in capsys.readouterr().err
