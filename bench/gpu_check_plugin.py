"""A pytest plugin for bench/gpu_check.py's tests stage (`-p gpu_check_plugin`): on a lent GPU machine a hang must
not eat the lease, and a failure must be readable even if a later test is killed.

Each test gets SHARDWISE_TEST_LIMIT seconds (default 75): a few seconds before, faulthandler dumps every thread's
stack to stderr (where a thread rank waits), then SIGALRM raises TimeoutError in the test (pytest-timeout is not
on the GPU machine's Python). Every failure's traceback is written to stderr as soon as it happens."""

from __future__ import annotations

import faulthandler
import os
import signal
import sys

import pytest

LIMIT = int(os.environ.get("SHARDWISE_TEST_LIMIT", "75"))


def _expired(signum, frame):
    raise TimeoutError(f"gpu_check_plugin: this test ran past {LIMIT} s (every thread's stack is above in stderr)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    previous = signal.signal(signal.SIGALRM, _expired)
    faulthandler.dump_traceback_later(max(LIMIT - 3, 1), exit=False)
    signal.alarm(LIMIT)
    try:
        yield
    finally:
        signal.alarm(0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, previous)


def pytest_runtest_logreport(report):
    if report.failed:
        sys.stderr.write(f"\n===== FAILED {report.nodeid} ({report.when}, {report.duration:.1f} s)\n"
                         f"{report.longreprtext[-6000:]}\n")
        sys.stderr.flush()
