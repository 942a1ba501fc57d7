"""Starting ranks: where this process sits in a job, `init()` inside a launched job, `launch()` of local ranks, logs.

    environment.py   LaunchEnvironment / detect_environment(): rank, world size and rendezvous address from the
                     variables of torchrun, Open MPI, PMI (MPICH, Intel MPI) or Slurm
    init.py          init(): join the job this process was launched into; a world of one without a launcher
    processes.py     launch(fn, n): thread ranks, or spawned gloo processes on 127.0.0.1
    mpi.py           launch(fn, n, backend="mpi"): the parent's side of a job under mpirun
    mpi_rank.py      ... and each rank's side (run by mpirun, never imported)
    errors.py        LaunchError, naming the first rank that failed with its traceback
    detector.py      FailureDetector: which rank failed first by time (died, raised, stalled), from the ranks' reports,
                     their processes' exits and their heartbeats (comm/heartbeat.py)
    logs.py          get_logger(): `[rank 3] INFO shardwise.ddp: ...` lines
    supervise.py     `shardwise run`: start a script's ranks and supervise them (gloo / nccl; attempts), with
                     run_config.py (RunConfig, failure policies), rank_processes.py (environment, teardown),
                     run_mpi.py (under mpirun), restarts.py (--max-restarts), run_report.py, run_rank.py (each rank)

This package sits on comm/ (it builds Communicators; all torch.distributed calls are in comm/rendezvous.py) and
below every strategy: nothing here imports ddp, sharding or the other strategies, and comm/ never imports launch.

`shardwise.launch` is also the name of the function `launch`: `shardwise/__init__.py` re-exports it as
`from .launch import launch`, which rebinds the package attribute to the function (as torch does with similar
names). Import from this package with `from shardwise.launch import LaunchError` or
`from shardwise.launch.mpi import mpirun_command`; `import shardwise.launch.mpi as m` would look `mpi` up on the
function and fail.
"""

from .environment import LaunchEnvironment, detect_environment
from .errors import LaunchError
from .init import init
from .logs import get_logger, set_log_rank
from .processes import launch

__all__ = ["LaunchEnvironment", "LaunchError", "detect_environment", "get_logger", "init", "launch", "set_log_rank"]
