"""One rank of `launch(fn, n, backend="mpi")`: run as `python -m shardwise.launch.mpi_rank <job dir>` by mpirun.

The rank reads the job the parent wrote (see mpi.py), builds the world MPICommunicator, runs `fn(comm, *args)` and
writes its report atomically (temporary file, then rename) to `report_path(job_dir, rank)`. A function of the
parent's main script is found as multiprocessing's spawn finds it: the script is run again here under the name
`__mp_main__`, so its `if __name__ == "__main__":` block stays quiet. A rank that fails aborts the MPI job at once:
its peers may be blocked in a collective it will never join.

This module is not imported by the package (only run by mpirun), so `python -m` executes it exactly once.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
import traceback

from .logs import start_rank_logging
from .mpi import report_path

__all__: list[str] = []


def _write(job_dir: str, rank: int, report: tuple) -> None:
    path = report_path(job_dir, rank)
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

    from ..comm.mpi_backend import MPICommunicator  # initialises MPI

    with open(os.path.join(job_dir, "job.pkl"), "rb") as f:
        job = pickle.load(f)
    comm = MPICommunicator(timeout=job["timeout"])
    start_rank_logging(comm.rank, job["logs"])
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
