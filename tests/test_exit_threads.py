"""No shardwise daemon thread is inside a torch or store call when a rank's process exits.

A daemon thread that comes back from C++ (a torch op, a TCPStore request) into an interpreter that is finalizing is
ended by a forced unwind, which a C++ frame that may not throw turns into std::terminate: "terminate called without
an active exception", SIGABRT after a job that succeeded (seen on loaded CI machines). `leave_world` (run at exit by
every process rank) therefore lets the background collectives' threads finish their jobs and end, and waits for the
heartbeat's last store call.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from shardwise.comm import heartbeat
from shardwise.comm.background import SerialWorker, stop_workers

WORKER = Path(__file__).with_name("exit_threads_worker.py")


def _slow_job(done: list[str]) -> None:
    time.sleep(0.3)
    torch.ones(4).add_(1)  # a torch call, as a real collective's step
    done.append("job")


def test_stop_workers_lets_a_job_in_flight_finish_and_ends_every_thread():
    done: list[str] = []
    busy, idle = SerialWorker("test-busy"), SerialWorker("test-idle")
    work = busy.submit(lambda: _slow_job(done))
    idle.submit(lambda: None).wait()
    threads = [busy.thread, idle.thread]
    assert stop_workers(10.0) == []
    assert done == ["job"] and work.is_completed()
    assert not any(t.is_alive() for t in threads)
    # a later job starts the thread again
    assert busy.submit(lambda: done.append("again")).wait() and done == ["job", "again"]
    busy.stop(5.0)


def test_stop_workers_names_a_worker_whose_job_outlasts_the_wait():
    release = threading.Event()
    stuck = SerialWorker("test-stuck")
    stuck.submit(release.wait)
    assert stop_workers(0.2) == ["test-stuck"]
    release.set()


class _SlowStore:
    """A store client whose `set` answers after `delay` seconds (a loaded store host)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.values: dict[str, str] = {}

    def clone(self):
        return self

    def set_timeout(self, _) -> None:
        pass

    def set(self, key: str, value: str) -> None:
        time.sleep(self.delay)
        self.values[key] = value


def test_the_heartbeats_stop_waits_for_a_store_call_it_had_abandoned():
    store = _SlowStore(0.6)
    beat = heartbeat.Heartbeat(store, 0, heartbeat.Activity(), interval=0.05)
    beat.store.limit = 0.4  # the call overruns its limit: abandoned, still running
    beat.start()  # publishes once: that call is abandoned after 0.4 s, answered after 0.6 s
    pending = beat.store._pending
    assert pending is not None and pending.is_alive()
    beat.stop()
    assert not pending.is_alive()  # stop returned only once it had come back


def test_no_gloo_thread_is_left_when_a_rank_exits():
    """Every process group is destroyed as the world is left (comm/group_release.py): the sub-groups communicators
    hold, and the world group that torch.distributed.nn.functional's default arguments held. Before, gloo's worker
    threads ran on into the interpreter's finalization, where one that freed a finished Work's tensors aborted the
    rank (SIGABRT after a job that succeeded, 1 run in 40 of examples/train.py on a loaded 2-core machine)."""
    result = subprocess.run([sys.executable, "-m", "shardwise", "run", "-n", "3", str(WORKER)], capture_output=True,
                            text=True, timeout=120, cwd=WORKER.parent.parent)
    assert result.returncode == 0, result.stderr
    left = re.findall(r"native threads left at exit: (\d+)", result.stdout + result.stderr)
    assert left == ["0", "0", "0"], result.stdout + result.stderr
