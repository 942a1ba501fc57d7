"""`launch(fn, n, backend="mpi")`: run `fn(comm, *args)` on n ranks under `mpirun -np n`, and each rank's side of it.

The parent writes the job (fn by reference, args, timeout, threads) to a private temporary directory and runs

    mpirun -np n [--oversubscribe --bind-to none --allow-run-as-root] <python> -m shardwise._mpi_launch <dir>

with the parent's sys.path as PYTHONPATH, so fn's module (a test helper in tests/, say) imports in every rank. A
function of the main script is found as multiprocessing's spawn finds it: the script is run again in each rank under
the name `__mp_main__`, so its `if __name__ == "__main__":` block stays quiet. Each rank builds an MPICommunicator,
runs fn and writes `rank<r>.pkl`: its pickled result, or its error and traceback text (the files are our own
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
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["launch_mpi", "mpirun_command"]

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


def launch_mpi(fn: Callable[..., Any], n: int, args: tuple, timeout: float, threads: int | None) -> list[Any]:
    """`launch(fn, n, *args, backend="mpi")` (see the module docstring): the results in rank order, or LaunchError."""
    from .runtime import LaunchError

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
            pickle.dump({"payload": payload, "main_path": main_path, "timeout": timeout, "threads": threads}, f)
        env = dict(os.environ)
        paths = [os.path.abspath(p or os.curdir) for p in sys.path]
        paths += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        command += [sys.executable, "-m", "shardwise._mpi_launch", job_dir]
        code, tail = _run(command, env, job_dir, n)
        return _collect(job_dir, n, code, tail, LaunchError)
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


def _collect(job_dir: str, n: int, code: int, tail: str, launch_error: type) -> list[Any]:
    reports: dict[int, tuple] = {}
    for r in range(n):
        path = os.path.join(job_dir, f"rank{r}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as f:
                reports[r] = pickle.load(f)
    errors = sorted((rep[4], r) for r, rep in reports.items() if rep[0] == "error")
    exit_note = f" (mpirun exited with code {code})"
    if errors:
        _, rank = errors[0]
        _, _, summary, text, _ = reports[rank]
        raise launch_error(rank, summary + exit_note, text)
    missing = [r for r in range(n) if r not in reports]
    if missing:
        found = re.search(r"(?:Process name: \[\[\d+,\d+\],|rank )(\d+)", tail)
        rank = int(found.group(1)) if found else missing[0]
        raise launch_error(rank, f"no result from rank(s) {missing}{exit_note}", f"mpirun output (last lines):\n{tail}")
    if code != 0:
        raise launch_error(0, f"every rank returned but{exit_note}", f"mpirun output (last lines):\n{tail}")
    return [pickle.loads(reports[r][1]) for r in range(n)]


# ---- inside each rank ---------------------------------------------------------------------------------------------------
def _write(job_dir: str, rank: int, report: tuple) -> None:
    path = os.path.join(job_dir, f"rank{rank}.pkl")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(report, f)
    os.replace(path + ".tmp", path)  # the parent never reads half a file


def _load_main(path: str) -> None:
    """Run the parent's main script as `__mp_main__` and make it `__main__` here, so `__main__.fn` resolves."""
    import runpy
    import types

    module = types.ModuleType("__mp_main__")
    module.__dict__.update(runpy.run_path(path, run_name="__mp_main__"))
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module


def _rank_main(job_dir: str) -> int:
    import torch

    from .comm.mpi_backend import MPICommunicator
    from .runtime import set_log_rank

    with open(os.path.join(job_dir, "job.pkl"), "rb") as f:
        job = pickle.load(f)
    comm = MPICommunicator(timeout=job["timeout"])
    set_log_rank(comm.rank)
    torch.set_num_threads(job["threads"])
    try:
        if job["main_path"]:
            _load_main(job["main_path"])
        fn, args = pickle.loads(job["payload"])
        result = fn(comm, *args)
        _write(job_dir, comm.rank, ("ok", pickle.dumps(result), "", "", time.time()))
        return 0
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent, named by rank
        _write(job_dir, comm.rank, ("error", "", f"{type(exc).__name__}: {exc}", traceback.format_exc(), time.time()))
        comm.abort(1)  # the peers may be blocked in a collective this rank will never join
        return 1


if __name__ == "__main__":
    sys.exit(_rank_main(sys.argv[1]))
