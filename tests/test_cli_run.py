"""`shardwise run` (launch/supervise.py): it trains a user's script on gloo processes, names the rank that failed first
with its traceback, stops the ranks that hang, leaves no process behind, and asks its policy before tearing down.

The command line runs end to end where it adds something (training, a rank killed by a signal and its exit code, two
nodes); the rank that raises and the rank that hangs run the supervisor in this process (`run()`, whose report the
command prints as it is), which saves an interpreter importing torch per test."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from ports import free_port

from shardwise.launch.supervise import CONTINUE, RunConfig, keep_survivors, run, tear_down
from shardwise_cli import main

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "train.py"
TRAIN_ARGS = ["--steps", "4", "--preset", "tiny", "--batch-size", "4", "--log-every", "2"]
_LOGGED = re.compile(r"\[rank 0\] INFO shardwise\.train: step (\d+)/\d+ +loss ([0-9.]+) +(\d+) tokens/s")


def _shardwise(*argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardwise", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def _losses(text: str) -> dict[int, float]:
    return {int(step): float(loss) for step, loss, _ in _LOGGED.findall(text)}


def test_run_trains_the_example_like_one_process_on_the_global_batch():
    """2 ranks x 4 rows give the losses one process logs with 8 rows (the same global batch), and rank 0 logs
    loss and tokens/s."""
    two = _shardwise("run", "-n", "2", str(TRAIN), *TRAIN_ARGS)
    assert two.returncode == 0, two.stderr
    one = subprocess.run([sys.executable, str(TRAIN), *TRAIN_ARGS[:-4], "--batch-size", "8", "--log-every", "2"],
                         capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert one.returncode == 0, one.stderr
    got, want = _losses(two.stderr), _losses(one.stderr)
    assert sorted(got) == [2, 4] and sorted(want) == [2, 4], two.stderr
    for step in want:
        assert got[step] == pytest.approx(want[step], abs=2e-4), (step, got, want)
    assert got[4] < got[2], "the loss did not go down"
    assert "on 2 rank(s)" in two.stderr and all(int(t) > 0 for _, _, t in _LOGGED.findall(two.stderr))


def test_a_rank_that_raises_fails_the_run_with_its_traceback(tmp_path, capfd):
    script = _script(tmp_path, """
        import torch, shardwise as sw
        comm = sw.init()
        t = torch.ones(3)
        comm.all_reduce(t)
        if comm.rank == 1:
            raise ValueError("bad batch on rank 1")
        comm.all_reduce(t)  # rank 0 waits here for rank 1
    """)
    result = run(RunConfig(script, nproc=2), out=io.StringIO())
    assert result.exit_code == 1, result.report()
    report = result.report()
    assert report.startswith("shardwise run: rank 1 failed first: ValueError: bad batch on rank 1"), report
    root = report.split("--- traceback of rank 1 (the root cause) ---")[1].split("---")[0]
    assert f'File "{script}", line 7, in <module>' in root and 'raise ValueError("bad batch on rank 1")' in root
    assert "run_rank.py" not in root  # the wrapper's frames are not the user's business
    # rank 0 failed in its all-reduce, and its CommError names rank 1's exception as the cause
    assert re.search(r"--- rank 0 failed too: CommError: all_reduce.*rank 1 failed: ValueError", report), report
    # Each failure is shown once: the ranks say one line each, the report holds the root cause's traceback only
    # (rank 0's CommError is a wait on rank 1, its one line names it).
    ranks_said = capfd.readouterr().err
    assert "rank 1 raised ValueError: bad batch on rank 1 (traceback in the report at the end)" in ranks_said
    assert "Traceback" not in ranks_said and 'raise ValueError("bad batch' not in ranks_said, ranks_said
    assert report.count("Traceback (most recent call last)") == 1, report


def test_a_hanging_rank_is_stopped_with_its_stack_and_no_process_is_left(tmp_path):
    pid_file = tmp_path / "pid0"
    script = _script(tmp_path, f"""
        import os, time, shardwise as sw
        comm = sw.init()
        if comm.rank == 1:
            time.sleep(0.5)
            raise RuntimeError("rank 1 gives up")
        open({str(pid_file)!r}, "w").write(str(os.getpid()))
        while True:
            time.sleep(0.05)  # never reaches a collective: only the supervisor can stop it
    """)
    start = time.monotonic()
    result = run(RunConfig(script, nproc=2, grace=1.0), out=io.StringIO())
    took = time.monotonic() - start
    report = result.report()
    assert result.exit_code == 1, report
    assert "shardwise run: rank 1 failed first: RuntimeError: rank 1 gives up" in report
    assert "shardwise run: stopped rank(s) [0], still running when the job was torn down" in report
    stack = report.split("--- Python stack of rank 0 when it was stopped ---")[1]
    assert f'File "{script}", line 9 in <module>' in stack, stack
    assert took < 60, f"stopping the hanging rank took {took:.0f}s"
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_ctrl_c_stops_the_job_saying_where_each_rank_was(tmp_path):
    script = _script(tmp_path, f"""
        import time, shardwise as sw
        comm = sw.init()
        open({str(tmp_path / "started")!r} + str(comm.rank), "w").close()
        while True:
            time.sleep(0.05)
    """)
    proc = subprocess.Popen([sys.executable, "-m", "shardwise", "run", "-n", "2", "--grace", "1", script],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"started{r}").exists() for r in range(2)) and time.monotonic() < deadline:
            time.sleep(0.1)
        os.killpg(proc.pid, 2)  # what a terminal's Ctrl-C sends to the foreground process group
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out
    assert "stopped by SIGINT" in out
    for rank in range(2):  # one line per rank: where the user's code was, not every helper thread's idle stack
        assert f'rank {rank} was at "{script}", line 6 in <module>' in out, out
    assert "Thread 0x" not in out and "heartbeat" not in out and len(out.splitlines()) <= 8, out


def test_a_rank_killed_by_a_signal_is_named_with_it(tmp_path):
    script = _script(tmp_path, """
        import os, signal, time, shardwise as sw
        comm = sw.init()
        if comm.rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(30)
    """)
    result = _shardwise("run", "-n", "2", "--grace", "1", script, timeout=120)
    assert result.returncode == 128 + 9, result.stderr
    assert "shardwise run: rank 0 failed first: killed by SIGKILL" in result.stderr


def test_a_rank_aborted_in_native_code_shows_where_its_threads_were(tmp_path):
    """SIGABRT (a C++ std::terminate at exit, "terminate called without an active exception") leaves no Python
    traceback: the report shows every thread's stack, which faulthandler wrote when the signal arrived."""
    script = _script(tmp_path, """
        import os, time, shardwise as sw
        comm = sw.init()
        if comm.rank == 1:
            os.abort()
        time.sleep(30)
    """)
    result = _shardwise("run", "-n", "2", "--grace", "1", script, timeout=120)
    assert result.returncode == 128 + 6, result.stderr
    assert "shardwise run: rank 1 failed first: killed by SIGABRT" in result.stderr
    root = result.stderr.split("--- traceback of rank 1 (the root cause) ---")[1]
    assert "Fatal Python error: Aborted" in root and f'File "{script}", line 5 in <module>' in root, root


def _survivor_script(tmp_path: Path) -> tuple[str, Path]:
    marker = tmp_path / "survivor-finished"
    return _script(tmp_path, f"""
        import os, time
        rank = int(os.environ["RANK"])  # no collectives: asynchronous workers that do not wait for each other
        if rank == 1:
            raise RuntimeError("worker 1 lost")
        time.sleep(3.0)
        open({str(marker)!r}, "w").write("done")
    """), marker


def test_the_policy_decides_whether_survivors_keep_running(tmp_path, capsys):
    script, marker = _survivor_script(tmp_path)
    seen = []

    def policy(failure, job):
        seen.append((failure.rank, failure.summary, job.running))
        return keep_survivors(failure, job)

    result = run(RunConfig(script, nproc=2), policy)
    assert marker.exists(), "keep_survivors stopped the surviving rank"
    assert seen == [(1, "RuntimeError: worker 1 lost", (0,))]
    assert result.exit_code == 1 and [f.rank for f in result.failures] == [1] and not result.stopped
    assert keep_survivors(result.failures[0], None) == CONTINUE

    # tear_down, the default, stopping the survivor: test_a_hanging_rank_is_stopped_with_its_stack_...
    assert tear_down(result.failures[0], None) == "stop"


def test_two_nodes_each_with_its_own_supervisor_train_together(tmp_path):
    """--nnodes 2 on one host: node 0's supervisor hosts the store, node 1's joins it; ranks 0 and 1 train."""
    port = str(free_port())
    common = ["run", "-n", "1", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port]
    nodes = [subprocess.Popen([sys.executable, "-m", "shardwise", *common, "--node-rank", str(k), str(TRAIN),
                               *TRAIN_ARGS], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for k in (0, 1)]
    outputs = [p.communicate(timeout=240) for p in nodes]
    # A string message is shown whole (a list would be cut short): the end of each node's stderr names a crash.
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(f"node {k} stderr (end):\n{err[-4000:]}"
                                                           for k, (_, err) in enumerate(outputs))
    assert "ranks 1..1 of 2" in outputs[1][1] and "on 2 rank(s)" in outputs[0][1]
    assert sorted(_losses(outputs[0][1])) == [2, 4]


@pytest.mark.parametrize("argv, needle", [
    (["run", "--nnodes", "2", "X"], "argument --master-port: required with --nnodes 2"),
    (["run", "--nnodes", "2", "--node-rank", "2", "--master-port", "29500", "X"],
     "argument --node-rank: 2 must be in 0..nnodes-1 = 0..1"),
    (["run", "-n", "0", "X"], "argument -n/--nproc/--nproc-per-node: 0 must be >= 1"),
    (["run", "--backend", "tcp", "X"], "argument --backend: invalid choice: 'tcp'"),
    (["run", "--master-port", "70000", "X"], "argument --master-port: 70000 is not a TCP port"),
    (["run", "-n", "2", "/no/such/train.py"], "argument script: '/no/such/train.py' is not a file"),
])
def test_usage_errors_name_the_option(argv, needle, capsys):
    argv = [str(TRAIN) if a == "X" else a for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert needle in capsys.readouterr().err


def test_run_config_rejects_what_it_cannot_start(tmp_path):
    with pytest.raises(ValueError, match=r"backend='mpi' places ranks on hosts through mpirun"):
        RunConfig(str(TRAIN), nproc=2, backend="mpi", nnodes=2, master_port=29500)
    with pytest.raises(ValueError, match=r"script '.*nothing\.py' is not a file"):
        RunConfig(str(tmp_path / "nothing.py"))
    with pytest.raises(ValueError, match=r"backend='tcp' is not supported; allowed \('gloo', 'nccl', 'mpi'\)"):
        RunConfig(str(TRAIN), backend="tcp")
