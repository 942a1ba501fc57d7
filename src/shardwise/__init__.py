"""shardwise: train one PyTorch model across many processes with every major parallelism strategy.

    import shardwise as sw
    comm = sw.init()                          # torchrun / mpirun / Slurm environment, or a world of one
    model = sw.DDP(model, comm)               # then a plain PyTorch training loop
    results = sw.launch(fn, world_size=4)     # run fn(comm) on 4 ranks (threads, or backend="gloo" processes)

See README.md and docs/ for the user guide.
"""

from .async_sgd import AsyncSGD, DiLoCo, LocalSGD, StreamingDiLoCo
from .check import CheckReport, check
from .checkpoint import CheckpointError, export_full, import_full, load_checkpoint, save_checkpoint
from .comm import CommError, CommStats, Communicator, ReduceOp, Work
from .consensus import agree
from .ddp import DDP, DDPModule
from .distribute import Distribution, distribute
from .estimate import MemoryEstimate, estimate_memory
# `launch` is both a subpackage and its function: this import binds the attribute shardwise.launch to the function.
from .launch import LaunchEnvironment, LaunchError, detect_environment, get_logger, init, launch
from .hybrid import HybridModel, parallelize
from .mesh import Coordinates, Mesh
from .sharding import FSDP, MixedPrecision, ShardedModule, ZeRO
from .sync_batchnorm import SyncBatchNorm
from .whole import (MemoryStats, ReplicaMismatch, ShardedGradScaler, check_replicas, clip_grad_norm_,
                    full_optimizer_state_dict, full_state_dict, load_full_optimizer_state_dict, load_full_state_dict,
                    memory_stats)

from . import compression, context_parallel, elastic, experts, layout, pipeline, tensor_parallel  # pipeline as pp

__version__ = "0.1.0"

__all__ = [
    "AsyncSGD",
    "CheckReport",
    "CheckpointError",
    "CommError",
    "CommStats",
    "Communicator",
    "Coordinates",
    "DDP",
    "DDPModule",
    "DiLoCo",
    "Distribution",
    "FSDP",
    "HybridModel",
    "LaunchEnvironment",
    "LaunchError",
    "LocalSGD",
    "MemoryEstimate",
    "MemoryStats",
    "MixedPrecision",
    "Mesh",
    "ReduceOp",
    "ReplicaMismatch",
    "ShardedGradScaler",
    "ShardedModule",
    "StreamingDiLoCo",
    "SyncBatchNorm",
    "Work",
    "ZeRO",
    "agree",
    "check",
    "check_replicas",
    "clip_grad_norm_",
    "compression",
    "detect_environment",
    "distribute",
    "elastic",
    "estimate_memory",
    "export_full",
    "full_optimizer_state_dict",
    "full_state_dict",
    "get_logger",
    "import_full",
    "init",
    "launch",
    "layout",
    "load_checkpoint",
    "load_full_optimizer_state_dict",
    "load_full_state_dict",
    "memory_stats",
    "parallelize",
    "pipeline",
    "save_checkpoint",
    "tensor_parallel",
    "context_parallel",
    "experts",
]
