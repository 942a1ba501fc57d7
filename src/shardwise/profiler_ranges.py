"""Named ranges in torch.profiler traces: what shardwise's hooks were doing when the host or the device was busy.

Under `torch.profiler.profile(...)` every forward, backward and end-of-backward hook of the sharding engine
(ZeRO-1/2/3, FSDP) and the DDP reducer, and every action of the pipeline executor, runs inside a `record_function`
range named `shardwise::<what> (<unit>)`, e.g. `shardwise::pre_forward (blocks.3)`, `shardwise::finish_backward`,
so a trace (Chrome/Perfetto) or `prof.key_averages()` shows how much host time each hook took and which collective
or copy ran inside it, next to PyTorch's own `FSDP::pre_forward (...)` ranges of FSDP2. The ranges:

    shardwise::root_pre_forward              the start of a sharded model's forward (the root unit's gather)
    shardwise::pre_forward (unit)            wait for the unit's all-gather, swap it in, prefetch the next
    shardwise::post_forward (unit)           output hooks; free the previous unit (reshard after forward)
    shardwise::pre_backward (unit)           re-gather if freed, gradient views, prefetch the previous unit
    shardwise::reduce_scatter (unit)         a unit's last gradient is in: launch its reduction
    shardwise::finish_reduce (unit)          wait for that reduction and hand the shard to `.grad`
    shardwise::finish_backward               end of backward: the remaining reductions, free, swap back
    shardwise::ddp_all_reduce (bucket i)     a DDP bucket is ready: launch its all-reduce
    shardwise::ddp_finish_backward           DDP's end of backward: wait for the buckets, hand out gradients
    shardwise::pipeline (1F3)                a pipeline rank's compute action (stage 1, forward of microbatch 3)
    shardwise::pipeline_p2p (0SEND_F1 ...)   a batch of its sends and receives, posted together

Cost when no profiler is running: one check of torch's profiler flag per range (well under a microsecond), so the
ranges stay in always; `record_function` itself costs ~10-20 us per range even when nothing records, which is why
it is entered only while a profiler is on. Mechanism as PyTorch FSDP2's `record_function` ranges
(torch/distributed/fsdp/_fully_shard), with the enablement check of torch's own `_record_function_with_args_enter`.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.profiler import record_function

__all__ = ["profiler_range"]

_OFF = contextlib.nullcontext()  # reusable: entering and leaving it does nothing
# torch's own check, exported under torch.autograd and defined in its C extension (where older releases keep it).
_profiler_enabled = getattr(torch.autograd, "_profiler_enabled", None) or torch._C._autograd._profiler_enabled


def profiler_range(what: str, detail: Any = None) -> contextlib.AbstractContextManager:
    """`record_function("shardwise::<what> (<detail>)")` while a torch profiler records, else a no-op context.
    The name is only formatted when it will be recorded (hooks run this per unit per step): `detail` is any object
    (str() of it), a tuple or list is joined with spaces (a pipeline's batch of actions: "0SEND_F1 0RECV_B0")."""
    if not _profiler_enabled():
        return _OFF
    if isinstance(detail, (tuple, list)):
        detail = " ".join(map(str, detail))
    return record_function(f"shardwise::{what}" if detail is None else f"shardwise::{what} ({detail})")
