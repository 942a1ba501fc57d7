"""The data-parallel wrapper of each pipeline stage `sw.parallelize` builds (hybrid.py): DDP, ZeRO-1/2/3 or FSDP over
the data group, as the plan says."""

from __future__ import annotations

from torch import nn

from .comm.base import Communicator
from .compression.support import copies_reconciled
from .ddp import DDP
from .hybrid_plan import Plan
from .mesh import Mesh
from .sharding import FSDP, ZeRO

__all__ = ["data_group", "wrap_data_parallel"]


def wrap_data_parallel(stage: nn.Module, mesh: Mesh, plan: Plan) -> nn.Module:
    """`stage` wrapped by the plan's dp_strategy over `data_group(mesh)`."""
    # HybridModel averages the copies of tp-replicated and pipeline-tied parameters after the reduction
    # (hybrid_copies.average_copies_gradients), so compression may see them.
    with copies_reconciled():
        return _wrap_stage(stage, mesh, plan)


def data_group(mesh: Mesh) -> Communicator:
    """The ranks dense gradients average over: dp, or dp x cp when the sequence is split too (each cp rank's loss is
    the mean over an equal share of every sequence's tokens)."""
    return mesh.dp if mesh.sizes["cp"] == 1 else mesh.dp_cp


def _wrap_stage(stage: nn.Module, mesh: Mesh, plan: Plan) -> nn.Module:
    group = data_group(mesh)
    if plan.dp_strategy == "ddp":
        return DDP(stage, group, compression=plan.compression, find_unused_parameters=plan.find_unused_parameters,
                   buffer_writes=plan.buffer_writes)
    mp = plan.mixed_precision
    if plan.dp_strategy.startswith("zero"):
        return ZeRO(stage, group, stage=int(plan.dp_strategy[-1]), mixed_precision=mp, cpu_offload=plan.cpu_offload,
                    compression=plan.compression, buffer_writes=plan.buffer_writes)
    sharding = plan.dp_strategy.split(":", 1)[1]
    shard_size = plan.dp_shard if sharding == "hybrid_shard" else None
    return FSDP(stage, group, sharding=sharding, shard_size=shard_size, mixed_precision=mp,
                cpu_offload=plan.cpu_offload, compression=plan.compression, buffer_writes=plan.buffer_writes)
