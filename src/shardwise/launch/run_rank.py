"""One rank of `shardwise run`: run the user's script as `__main__` and tell the supervisor how it ended.

`shardwise run` (supervise.py) starts every rank as

    <python> -m shardwise.launch.run_rank <script> <args...>

with the environment `sw.init()` reads (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...; or mpirun's own) plus
SHARDWISE_RUN_DIR, a private folder of the job. This module runs the script exactly as `python <script> <args>`
would (sys.argv, `__name__ == "__main__"`, the script's folder first on sys.path) and adds three things, as
torchrun's `@record` error files do:

* When the script raises, the rank writes `rank<r>.json` in SHARDWISE_RUN_DIR (`error_report`: one-line summary,
  traceback, wall time, and for a CommError the peers it waited for) before it exits with code 1, so the supervisor
  knows the exception and its time, not just an exit code. The supervisor prints that traceback once, in its
  closing report (without the frames of this wrapper); the rank itself prints one line (the whole traceback only
  when it could not write the report), and the exit hook of `sw.init()` publishes it to the peers' heartbeat board.
* SIGUSR1 dumps every thread's Python stack to `rank<r>.stack` (faulthandler): the supervisor asks a rank that hangs
  for its stack before stopping it.
* A watchdog thread exits the rank when the supervisor disappears (its parent process changed), so a killed
  supervisor leaves no orphans training on.
"""

from __future__ import annotations

import faulthandler
import json
import os
import runpy
import signal
import sys
import threading
import time
import traceback

from .detector import error_report
from .environment import detect_environment

RUN_DIR_ENV = "SHARDWISE_RUN_DIR"
SUPERVISOR_PID_ENV = "SHARDWISE_SUPERVISOR_PID"
#: "1" when the supervisor's closing report will print this rank's traceback (a job with no restarts): the rank then
#: prints one line instead of the whole traceback, so each failure is shown once.
TRACEBACK_IN_REPORT_ENV = "SHARDWISE_TRACEBACK_IN_REPORT"


def report_file(run_dir: str, rank: int) -> str:
    """Where rank `rank` reports its exception (JSON of `error_report`)."""
    return os.path.join(run_dir, f"rank{rank}.json")


def stack_file(run_dir: str, rank: int) -> str:
    """Where rank `rank` dumps its Python stack on SIGUSR1."""
    return os.path.join(run_dir, f"rank{rank}.stack")


def _watch_supervisor(pid: int) -> None:
    """Exit this rank when the supervisor (our parent, or mpirun's parent) is gone: no orphan keeps training."""
    while True:
        time.sleep(1.0)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os._exit(1)
        except PermissionError:  # the pid exists (signal 0 only checks): still alive
            pass


def _without_wrapper_frames(exc: BaseException, script: str) -> BaseException:
    """The exception with its traceback starting at the script's first frame (runpy's and ours dropped)."""
    tb = exc.__traceback__
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != script:
        tb = tb.tb_next
    return exc.with_traceback(tb) if tb is not None else exc


def _write_report(run_dir: str, rank: int, exc: BaseException) -> None:
    path = report_file(run_dir, rank)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(error_report(exc), f)
    os.replace(tmp, path)  # atomic: the supervisor never reads half a report


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: python -m shardwise.launch.run_rank <script> [args...] (started by `shardwise run`)")
    script = os.path.abspath(argv[0])
    run_dir = os.environ.get(RUN_DIR_ENV)
    rank = detect_environment().rank
    stack = None
    if run_dir and hasattr(faulthandler, "register"):
        stack = open(stack_file(run_dir, rank), "w")  # noqa: SIM115 - held open for faulthandler until exit
        faulthandler.register(signal.SIGUSR1, file=stack, all_threads=True)
        # A fatal signal (SIGABRT from a C++ std::terminate, SIGSEGV) writes every thread's Python stack there too:
        # the report shows it instead of "no traceback" (run_report.py).
        faulthandler.enable(file=stack, all_threads=True)
    supervisor = os.environ.get(SUPERVISOR_PID_ENV)
    if supervisor:
        threading.Thread(target=_watch_supervisor, args=(int(supervisor),), name="shardwise-run-watchdog",
                         daemon=True).start()
    sys.argv = [argv[0], *argv[1:]]
    sys.path[0] = os.path.dirname(script)  # as `python script.py` has it (under -m it is the working directory)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit:
        raise  # the script chose its exit code; the supervisor reads it
    except BaseException as exc:  # noqa: BLE001 - every failure reaches the supervisor, KeyboardInterrupt included
        exc = _without_wrapper_frames(exc, script)
        reported = False  # whether the supervisor's report will show the traceback
        if run_dir:
            try:
                _write_report(run_dir, rank, exc)
                reported = os.environ.get(TRACEBACK_IN_REPORT_ENV) == "1"
            except OSError as write_error:  # the exit code still tells the supervisor that this rank failed
                print(f"shardwise run: rank {rank} could not write its error report: {write_error}", file=sys.stderr)
        # The supervisor prints a reported traceback once, in its closing report (root cause first): printing it here
        # too gave every failure twice. Unreported, it is printed here, not re-raised: a re-raise would put this
        # wrapper's frame back on top. sys.last_exc is what the interpreter sets for an uncaught exception; init()'s
        # exit hook publishes it to the peers.
        if reported:
            first = str(exc).strip().splitlines()
            print(f"shardwise run: rank {rank} raised {type(exc).__name__}{': ' + first[0] if first else ''} "
                  f"(traceback in the report at the end)", file=sys.stderr)
        else:
            traceback.print_exception(type(exc), exc, exc.__traceback__)
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
        sys.last_exc = exc
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
