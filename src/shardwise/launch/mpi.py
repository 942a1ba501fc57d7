"""`launch(fn, n, backend="mpi")`: run `fn(comm, *args)` on n ranks under `mpirun -np n` (the parent's side).

The parent writes the job (fn by reference, args, timeout, threads, whether rank logging is on) to a private
temporary directory and runs

    mpirun -np n [--oversubscribe --bind-to none --allow-run-as-root] <python> -m shardwise.launch.mpi_rank <dir>

with the parent's sys.path as PYTHONPATH, so fn's module (a test helper in tests/, say) imports in every rank. A
function of the main script is found as multiprocessing's spawn finds it (see mpi_rank.py). Each rank writes
`rank<r>.pkl` (`report_path`): its pickled result, or its error and traceback text (the files are our own
processes' output, read back by the process that wrote the job). A rank that fails aborts the MPI job at once so no
peer waits for it; a rank that times out in a collective raises CommError and then aborts it too. The parent relays
mpirun's output to its stderr, collects the files once mpirun exits and raises LaunchError naming the first rank
that failed (earliest failure; with no file at all, the rank mpirun's report names).
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from .errors import LaunchError
from .logs import rank_logging_installed

__all__ = ["launch_mpi", "mpirun_command", "report_path"]

# Once a rank reported failure (and aborted), or every rank reported success, mpirun must exit within this long.
_EXIT_GRACE_S = 30.0


def mpirun_command(n: int) -> list[str]:
    """The launcher's command line for n local ranks: `SHARDWISE_MPIRUN` (default `mpirun`) with Open MPI's flags for
    running anywhere (more ranks than cores, no core binding so ranks use their threads, root in containers)."""
    launcher = os.environ.get("SHARDWISE_MPIRUN", "mpirun")
    path = shutil.which(launcher)
    if path is None:
        raise RuntimeError(
            f"launch(backend='mpi') needs {launcher!r} on PATH: install Open MPI (`apt-get install openmpi-bin "
            f"libopenmpi-dev`) and mpi4py (`pip install mpi4py==4.1.2`), or use backend='gloo'"
        )
    version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    if "Open MPI" in version or "OpenRTE" in version:
        flags = ["--oversubscribe", "--bind-to", "none"]
        if os.geteuid() == 0:
            flags.append("--allow-run-as-root")
        return [path, "-np", str(n), *flags]
    return [path, "-n", str(n)]  # MPICH / Intel MPI (Hydra)


def report_path(job_dir: str, rank: int) -> str:
    """Where rank `rank` reports: a pickled tuple (status "ok" | "error", result pickle, summary, traceback text,
    time of the report). Written by mpi_rank.py, read by `launch_mpi` once mpirun exits."""
    return os.path.join(job_dir, f"rank{rank}.pkl")


def launch_mpi(fn: Callable[..., Any], n: int, args: tuple, timeout: float, threads: int | None) -> list[Any]:
    """`launch(fn, n, *args, backend="mpi")` (see the module docstring): the results in rank order, or LaunchError."""
    main_path = None
    if getattr(fn, "__module__", None) == "__main__":
        main_path = getattr(sys.modules["__main__"], "__file__", None)
        if main_path is None:
            raise ValueError("launch(backend='mpi') cannot run a function defined interactively; put it in a module")
    try:
        payload = pickle.dumps((fn, args))
    except Exception as exc:
        raise ValueError(
            f"launch(backend='mpi') needs a function importable by module and name (defined at module level) and "
            f"picklable arguments; {fn!r} cannot be pickled: {exc}"
        ) from None
    command = mpirun_command(n)
    threads = threads or max(1, (os.cpu_count() or 1) // n)
    job_dir = tempfile.mkdtemp(prefix="shardwise-mpi-")
    try:
        with open(os.path.join(job_dir, "job.pkl"), "wb") as f:
            pickle.dump({"payload": payload, "main_path": main_path, "timeout": timeout, "threads": threads,
                         "logs": rank_logging_installed()}, f)
        env = dict(os.environ)
        paths = [os.path.abspath(p or os.curdir) for p in sys.path]
        paths += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        command += [sys.executable, "-m", "shardwise.launch.mpi_rank", job_dir]
        code, tail = _run(command, env, job_dir, n)
        return _collect(job_dir, n, code, tail)
    finally:
        shutil.rmtree(job_dir, ignore_errors=True)


def _run(command: list[str], env: dict[str, str], job_dir: str, n: int) -> tuple[int, str]:
    """Run mpirun, relaying its output to stderr; kill it if it outlives the grace period after the ranks reported."""
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    lines: deque[str] = deque(maxlen=200)

    def relay() -> None:
        for raw in proc.stdout:  # type: ignore[union-attr]
            line = raw.decode(errors="replace")
            lines.append(line)
            sys.stderr.write(line)

    reader = threading.Thread(target=relay, name="shardwise-mpirun-output", daemon=True)
    reader.start()
    reported_at = None
    try:
        while proc.poll() is None:
            time.sleep(0.05)
            if reported_at is None:
                names = [f for f in os.listdir(job_dir) if f.endswith(".pkl") and f.startswith("rank")]
                if len(names) == n or any(_is_error(os.path.join(job_dir, f)) for f in names):
                    reported_at = time.monotonic()
            elif time.monotonic() - reported_at > _EXIT_GRACE_S:
                lines.append(f"shardwise: mpirun did not exit {_EXIT_GRACE_S:g}s after the ranks reported; killed\n")
                break
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
        reader.join(5)
    return code, "".join(lines)


def _is_error(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return pickle.load(f)[0] == "error"
    except Exception:  # being renamed into place; looked at again on the next poll
        return False


def _collect(job_dir: str, n: int, code: int, tail: str) -> list[Any]:
    reports: dict[int, tuple] = {}
    for r in range(n):
        path = report_path(job_dir, r)
        if os.path.exists(path):
            with open(path, "rb") as f:
                reports[r] = pickle.load(f)
    errors = sorted((rep[4], r) for r, rep in reports.items() if rep[0] == "error")
    exit_note = f" (mpirun exited with code {code})"
    if errors:
        _, rank = errors[0]
        _, _, summary, text, _ = reports[rank]
        raise LaunchError(rank, summary + exit_note, text)
    missing = [r for r in range(n) if r not in reports]
    if missing:
        found = re.search(r"(?:Process name: \[\[\d+,\d+\],|rank )(\d+)", tail)
        rank = int(found.group(1)) if found else missing[0]
        raise LaunchError(rank, f"no result from rank(s) {missing}{exit_note}", f"mpirun output (last lines):\n{tail}")
    if code != 0:
        raise LaunchError(0, f"every rank returned but{exit_note}", f"mpirun output (last lines):\n{tail}")
    return [pickle.loads(reports[r][1]) for r in range(n)]
