"""Blame the root cause: `launch` names the rank that failed first (killed, raised, stalled), the survivors' CommErrors
name it too, nothing hangs and no process outlives the launch (issue 12, item 5).

The gloo trials pick the victim rank and the step from a seeded RNG. One trial per fault runs in the normal suite;
`make soak` runs many seeds (SHARDWISE_SOAK_TRIALS, default 10 per fault).
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time

import pytest
import torch

import shardwise as sw
from shardwise.launch.detector import FailureDetector, error_report, exit_summary

N, STEPS = 3, 5
SOAK_TRIALS = int(os.environ.get("SHARDWISE_SOAK_TRIALS", "10"))
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _faulty_body(comm, fault, victim, step):
    """STEPS all-reduces; the victim kills itself, raises, or stalls at `step`, between two collectives."""
    for i in range(STEPS):
        if comm.rank == victim and i == step:
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault == "raise":
                raise ValueError(f"rank {victim} fails on purpose at step {step}")
            else:
                time.sleep(120)  # stalls far past the timeout; the launcher stops it
        t = torch.full((4,), float(comm.rank))
        comm.all_reduce(t)
        assert t.tolist() == [float(sum(range(comm.size)))] * 4
    return comm.rank


def _children() -> set[int]:
    """Live or unreaped (zombie) descendants of this process, but multiprocessing's resource tracker and fork server
    (helpers that live as long as this process). The ranks are the fork server's children (launch forks them from
    it), so its children count: a rank left behind there is an orphan all the same."""
    parents: dict[int, int] = {}
    commands: dict[int, bytes] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                commands[int(entry)] = f.read()
        except (OSError, IndexError, ValueError):
            continue
    me = os.getpid()
    helpers = {pid for pid, ppid in parents.items()
               if ppid == me and (b"resource_tracker" in commands[pid] or b"forkserver" in commands[pid])}
    return {pid for pid, ppid in parents.items() if (ppid == me and pid not in helpers) or ppid in helpers}


# What `launch` must say about the victim, and what each survivor's CommError must say about it.
EXPECTED = {
    "kill": ("killed by SIGKILL", "rank {v} killed by SIGKILL"),
    "raise": ("ValueError: rank {v} fails on purpose", "rank {v} raised ValueError"),
    "stall": ("stalled", "rank {v} is outside communication"),
}


def _trial(fault: str, seed: int) -> float:
    rng = random.Random(seed)
    victim, step = rng.randrange(N), rng.randrange(STEPS)
    timeout = 4.0 if fault == "stall" else 10.0
    before = _children()
    start = time.monotonic()
    with pytest.raises(sw.LaunchError) as info:
        sw.launch(_faulty_body, N, fault, victim, step, backend="gloo", timeout=timeout)
    elapsed = time.monotonic() - start
    err, (about_victim, from_survivors) = info.value, EXPECTED[fault]
    context = f"seed {seed}, victim {victim}, step {step}:\n{err}"
    assert err.rank == victim, context
    assert str(err).startswith(f"rank {victim} failed: "), context
    assert about_victim.format(v=victim) in err.summary, context
    if fault != "kill":  # the traceback of a raise, the stack of a stall: both point into the rank's body
        assert "_faulty_body" in err.remote_traceback, context
    survivors = dict(err.others)
    assert survivors and set(survivors) <= set(range(N)) - {victim}, context
    for rank, summary in survivors.items():
        assert summary.startswith("CommError: all_reduce"), context
        assert f"waiting for rank(s) [{victim}] of group [0, 1, 2]" in summary, context
        assert from_survivors.format(v=victim) in summary, context
    assert elapsed < timeout + 15, context
    assert _children() - before == set(), f"orphans after {context}"
    return elapsed


@linux_only
@pytest.mark.multiprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize("fault", ["kill", "raise", "stall"])
def test_launch_blames_the_rank_that_failed_first(fault):
    _trial(fault, seed=12)


@linux_only
@pytest.mark.soak
@pytest.mark.multiprocess
@pytest.mark.timeout(30 * SOAK_TRIALS)
@pytest.mark.parametrize("fault", ["kill", "raise", "stall"])
def test_soak_blame_over_many_seeds(fault):
    for seed in range(SOAK_TRIALS):
        _trial(fault, seed=1000 + seed)


# ---- thread ranks ------------------------------------------------------------------------------------------------
def test_thread_rank_that_raises_is_blamed_though_a_peer_timed_out_first():
    def body(comm):
        if comm.rank == 1:
            time.sleep(0.6)  # rank 0's receive times out first (CommError at 0.3 s) ...
            raise KeyError("the root cause")  # ... but this is why
        if comm.rank == 0:
            comm.recv(torch.empty(1), src=1)

    with pytest.raises(sw.LaunchError) as info:
        sw.launch(body, 2, timeout=0.3)
    err = info.value
    assert err.rank == 1 and "KeyError: 'the root cause'" in err.summary, str(err)
    assert "rank 1 never sent" in dict(err.others)[0]


def test_thread_rank_that_stalls_is_blamed_and_launch_returns():
    release = threading.Event()

    def body(comm):
        if comm.rank == 2:
            release.wait(30)  # stalls: never reaches the all-reduce while the others wait
            return None
        comm.all_reduce(torch.ones(1))

    start = time.monotonic()
    try:
        with pytest.raises(sw.LaunchError) as info:
            sw.launch(body, 3, timeout=0.5)
    finally:
        release.set()
    assert time.monotonic() - start < 10
    err = info.value
    assert err.rank == 2 and err.summary.startswith("stalled: rank"), str(err)
    for rank in (0, 1):
        assert "waiting for rank(s) [2], which never called it" in dict(err.others)[rank]


def test_thread_survivors_name_the_rank_that_raised():
    def body(comm):
        if comm.rank == 2:
            raise ValueError("boom")
        comm.all_reduce(torch.ones(1))

    with pytest.raises(sw.LaunchError) as info:
        sw.launch(body, 3, timeout=30)
    err = info.value
    assert err.rank == 2
    for rank, summary in err.others:
        assert "all_reduce" in summary and "rank 2 raised ValueError: boom" in summary, summary


# ---- the detector's rules, without ranks -------------------------------------------------------------------------
def _comm_report(peers, waited, when):
    exc = sw.CommError("all_reduce timed out", op="all_reduce", rank=0, peers=peers, waited=waited)
    return {**error_report(RuntimeError("wrapped")), "comm": error_report(exc)["comm"], "time": when,
            "summary": "CommError: all_reduce timed out"}


def test_detector_prefers_the_earliest_primary_failure_over_earlier_comm_errors():
    detector = FailureDetector(3)
    detector.report_error(0, _comm_report([1], 0.1, when=100.0))
    detector.report_error(1, {**error_report(ValueError("late but the cause")), "time": 101.0})
    detector.report_done(2)
    assert detector.settled()
    root = detector.first_failure()
    assert (root.rank, root.kind) == (1, "raised") and "late but the cause" in root.summary
    assert [f.rank for f in detector.failures()] == [1, 0]


def test_detector_calls_a_blamed_rank_that_still_runs_stalled_and_a_comm_error_alone_the_root():
    detector = FailureDetector(3, settle=0.0)
    detector.report_error(0, _comm_report([2], 5.0, when=100.0))
    root = detector.first_failure()
    assert (root.rank, root.kind, root.time) == (2, "stalled", 95.0) and "rank 0 waited 5.0s" in root.summary
    detector = FailureDetector(2)
    detector.report_error(0, _comm_report([1], 5.0, when=100.0))
    detector.report_done(1)  # the peer returned early: not a failure, so the CommError is the root
    assert (detector.first_failure().rank, detector.first_failure().kind) == (0, "comm")


def test_a_comm_error_wrapped_by_user_code_is_still_a_consequence():
    try:
        try:
            raise sw.CommError("recv timed out", op="recv", peers=[3], waited=1.0)
        except sw.CommError as exc:
            raise RuntimeError("training step failed") from exc
    except RuntimeError as wrapped:
        report = error_report(wrapped)
    assert report["comm"] == {"peers": [3], "waited": 1.0, "op": "recv"}
    assert report["summary"] == "RuntimeError: training step failed" and "recv timed out" in report["traceback"]


def test_exit_summaries_name_the_signal_or_code():
    assert exit_summary(-signal.SIGKILL) == "killed by SIGKILL"
    assert exit_summary(-signal.SIGSEGV) == "killed by SIGSEGV"
    assert exit_summary(3) == "exited with code 3"
