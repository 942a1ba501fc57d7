"""What `sw.parallelize` was asked for (`Plan`) and the checks that refuse, at wrap time and by name, every
combination it cannot train exactly (`check_plan`); hybrid.py does the wrapping."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from .compression.support import check_supported
from .context_parallel.compose import attention_dropout, check_method
from . import layout
from .buffer_writes import check_buffer_writes_option
from .mesh import Mesh
from .sharding import MixedPrecision

__all__ = ["Plan", "check_plan", "DP_STRATEGIES"]

DP_STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp:full_shard", "fsdp:shard_grad_op", "fsdp:hybrid_shard")


@dataclasses.dataclass(frozen=True)
class Plan:
    tp_plan: Any
    sequence_parallel: bool
    pp_schedule: str
    n_microbatches: int
    virtual_stages: int
    dp_strategy: str
    dp_shard: int | None
    activation_checkpointing: int
    mixed_precision: MixedPrecision | None = None
    cpu_offload: str = "none"
    compression: Any = None  # a sw.compression method for the dp axis (compression/support.py's table)
    find_unused_parameters: bool = False  # DDP's option (the sharding engine needs none: sharding/grad_layout.py)
    cp_method: str = "ring"  # context parallel's attention ("ring" or "ulysses"; context_parallel/apply.py)
    buffer_writes: str | None = None  # the dp wrappers' check of buffers a forward writes (buffer_writes.py)


def check_plan(mesh: Mesh, plan: Plan, model: nn.Module) -> None:
    """ValueError naming the argument for anything `parallelize` cannot do (called before anything is changed)."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"parallelize: model must be a torch.nn.Module, got {type(model).__name__}")
    if layout.is_wrapped(model):
        raise ValueError("parallelize: the model is already wrapped; pass the plain model (parallelize applies "
                         "tensor, pipeline and data parallelism itself)")
    if plan.dp_strategy not in DP_STRATEGIES:
        raise ValueError(f"parallelize: dp_strategy={plan.dp_strategy!r} is not supported; allowed {DP_STRATEGIES}")
    dp = mesh.sizes["dp"] * mesh.sizes["cp"]  # the data group's size (dp x cp: data_group)
    if mesh.sizes["cp"] > 1:  # tp first, then cp over each rank's n_heads / tp heads (context_parallel/compose.py)
        check_method(model, mesh.sizes["cp"], plan.cp_method, tp=mesh.sizes["tp"], who="parallelize", arg="cp_method")
        dropout = attention_dropout(model)
        if dropout is not None:  # context_parallel.apply refuses it too, but after tensor parallel has run
            raise ValueError(f"parallelize: cp={mesh.sizes['cp']} with {dropout[0]}={dropout[1]}: ring / Ulysses "
                             f"attention has no attention dropout; allowed: 0.0")
    if mesh.sizes["ep"] > 1 and plan.dp_strategy == "fsdp:hybrid_shard":
        raise ValueError(f"parallelize: ep={mesh.sizes['ep']} with dp_strategy='fsdp:hybrid_shard' is not supported "
                         f"(its shard groups cut across the ranks holding the same experts, edp); use 'ddp', 'zero1', "
                         f"'zero2', 'zero3', 'fsdp:full_shard' or 'fsdp:shard_grad_op'")
    if mesh.sizes["ep"] > 1 and plan.compression is not None:
        raise ValueError("parallelize: compression with ep > 1 is not supported (the experts reduce over their own "
                         "group, which the compressors do not cover yet)")
    if plan.dp_strategy == "fsdp:hybrid_shard":
        if isinstance(plan.dp_shard, bool) or not isinstance(plan.dp_shard, int) or plan.dp_shard < 1 \
                or dp % plan.dp_shard:
            raise ValueError(f"parallelize: dp_strategy='fsdp:hybrid_shard' needs dp_shard, a positive int dividing "
                             f"dp={dp}; got dp_shard={plan.dp_shard!r}")
    elif plan.dp_shard is not None:
        raise ValueError(f"parallelize: dp_shard={plan.dp_shard!r} only applies to dp_strategy='fsdp:hybrid_shard'")
    if mesh.sizes["tp"] > 1 and plan.tp_plan is None:
        raise ValueError(f"parallelize: the mesh has tp={mesh.sizes['tp']} but tp_plan is None; pass a plan "
                         f"(\"gpt\", \"llama\", \"gpt2\" or a dict)")
    if plan.mixed_precision is not None:
        if not isinstance(plan.mixed_precision, MixedPrecision):
            raise ValueError(f"parallelize: mixed_precision={plan.mixed_precision!r} must be a shardwise.MixedPrecision")
        if plan.dp_strategy == "ddp":
            raise ValueError("parallelize: mixed_precision needs a sharded dp_strategy (zero1/2/3 or fsdp:*), whose "
                             "engine keeps fp32 master weights; DDP trains in the model's own dtype")
    check_buffer_writes_option(plan.buffer_writes, "parallelize")
    if not isinstance(plan.find_unused_parameters, bool):
        raise ValueError(f"parallelize: find_unused_parameters={plan.find_unused_parameters!r} must be True or False")
    if plan.find_unused_parameters and plan.dp_strategy != "ddp":
        raise ValueError(f"parallelize: find_unused_parameters=True is DDP's option; dp_strategy="
                         f"{plan.dp_strategy!r} already leaves parameters no rank used with grad None")
    if plan.cpu_offload != "none" and plan.dp_strategy == "ddp":
        raise ValueError(f"parallelize: cpu_offload={plan.cpu_offload!r} needs a sharded dp_strategy (zero1/2/3 or "
                         f"fsdp:*), whose engine keeps the master shards that offload moves to the host; DDP has none")
    strategy = plan.dp_strategy.split(":", 1)[-1]  # "ddp", "zero1".."zero3", or FSDP's sharding name
    check_supported(plan.compression, strategy,
                    reduce_dtype=plan.mixed_precision.reduce_dtype if plan.mixed_precision is not None else None,
                    shard_size=plan.dp_shard or 1, replicas=dp // plan.dp_shard if plan.dp_shard else None)
    if plan.sequence_parallel and mesh.sizes["tp"] == 1:
        raise ValueError("parallelize: sequence_parallel=True needs tp > 1")
    if plan.pp_schedule == "zb_h1" and plan.dp_strategy != "ddp":
        raise ValueError("parallelize: pp_schedule='zb_h1' splits each backward into input and weight passes over "
                         "the stage's own parameters, which ZeRO / FSDP swap for gathered copies; use 'ddp' with "
                         "zb_h1, or '1f1b' / 'interleaved_1f1b' with ZeRO / FSDP")
