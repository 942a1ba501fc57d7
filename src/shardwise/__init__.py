"""shardwise: train one PyTorch model across many processes with every major parallelism strategy.

    import shardwise as sw
    comm = sw.init()                          # torchrun / mpirun / Slurm environment, or a world of one
    model = sw.DDP(model, comm)               # then a plain PyTorch training loop
    results = sw.launch(fn, world_size=4)     # run fn(comm) on 4 ranks (threads, or backend="gloo" processes)

See README.md and docs/ for the user guide.
"""

from .comm import CommError, CommStats, Communicator, ReduceOp, Work
from .ddp import DDP, DDPModule
from .environment import LaunchEnvironment, detect_environment
from .memory import MemoryStats, memory_stats
from .mesh import Coordinates, Mesh
from .runtime import LaunchError, get_logger, init, launch

__version__ = "0.1.0"

__all__ = [
    "CommError",
    "CommStats",
    "Communicator",
    "Coordinates",
    "DDP",
    "DDPModule",
    "LaunchEnvironment",
    "LaunchError",
    "MemoryStats",
    "Mesh",
    "ReduceOp",
    "Work",
    "detect_environment",
    "get_logger",
    "init",
    "launch",
    "memory_stats",
]
