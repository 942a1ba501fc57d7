"""Data parallel training: every rank holds the whole model, gradients are averaged with bucketed all-reduces
that overlap the backward pass (Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel
Training", VLDB 2020).

Mechanism
---------
* At wrap time the model moves to `comm.device` (this rank's GPU under NCCL; see placement.py), and rank 0's
  parameters and buffers are broadcast, so every replica starts equal.
* Trainable parameters are packed, in *reverse* registration order (roughly the order backward produces their
  gradients), into flat buckets of `bucket_mb` (the first one `first_bucket_mb`, small, so communication starts as
  early as possible). Each parameter's `.grad` becomes a view into its bucket, so no copy is needed on later steps.
* A post-accumulate-grad hook per parameter marks it ready. When the last parameter of a bucket is ready, and all
  earlier buckets have been launched, the bucket's all-reduce (AVG) is launched asynchronously, so it runs while
  autograd computes the gradients of earlier layers. Buckets are always launched in index order, which keeps the
  collective order identical on every rank even when hooks fire in a different order.
* A callback queued on the autograd engine runs when backward ends: it launches what is left, waits for every
  bucket, and only then does `loss.backward()` return, with every `.grad` holding the global average.
* `compression=`: each bucket is reduced by a `sw.compression` Compressor instead of the fp32 all-reduce (FP16,
  BF16, TopK, RandomK, PowerSGD, OneBit; see docs/compression.md): launched at the same moment, so its first round
  overlaps backward as the plain all-reduce does; what remains (PowerSGD's second round, decompression) runs when
  the bucket is waited for. Each rank holds its own copy (`model.compressor`) with its error-feedback memory per
  bucket, which `sw.save_checkpoint` saves per rank (declared as the layout's extra state).
* `no_sync()` skips communication: gradients accumulate locally and are averaged on the first backward outside it.
* Expert parallel (shardwise.experts): a parameter whose placement is split over ranks of `comm` (experts split over
  an ep group borrowed from dp) is not a replica across `comm`: it is neither broadcast nor averaged over `comm`, but
  bucketed apart and averaged over the replica group it declares inside `comm` (edp), or left alone when it has none
  (`replica_groups.data_parallel_group`).
* Unused parameters: by default a trainable parameter that got no gradient is an error naming it (it would leave
  its bucket waiting forever on the other ranks). With `find_unused_parameters=True` each forward walks the autograd
  graph to find the parameters it cannot reach and marks them ready at the start of backward (contributing zeros,
  or what they accumulated under no_sync); a small all-reduce of a used-flag per parameter then tells which are
  unused on every rank, and those keep `.grad` as it was (None), exactly as in single-process training.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

from torch import nn

from . import layout
from ._mixin import MovesRefused, mix_in
from .agreement import check_agreement, describe_parameters
from .comm.base import Communicator, is_communicator
from .comm.coalesced import broadcast_coalesced
from .compression.base import Compressor
from .compression.support import check_copies
from .optimizer_guard import register_wrapped
from .batch_norm_split import apply_batch_norm_choice
from .buffer_writes import check_buffer_writes_option, watch_buffer_writes
from .forward_methods import check_forward_methods, route_through_forward
from .embedding_rows import check_embedding_rows
from .batch_split import refuse_unsplittable_batch_statistics, share_batch_split
from .compiled import refuse_compiled
from .placement import to_comm_device
from .sharded_tensor import local
from .ddp_reducer import Reducer
from .replica_groups import data_parallel_group

__all__ = ["DDP", "DDPModule"]

log = logging.getLogger("shardwise.ddp")


class DDPModule(MovesRefused):
    """Mixed into a module's class by `DDP`: adds `no_sync()` and the forward-time buffer broadcast."""

    _ddp: Reducer

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._ddp.before_forward()
        try:
            output = super().forward(*args, **kwargs)
        except BaseException:
            self._ddp.failed = True  # the next forward recovers, after agreeing with the peers that they failed too
            raise
        self._ddp.after_forward(output)
        return output

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside this block accumulate gradients locally, with no communication."""
        previous = self._ddp.require_sync
        self._ddp.require_sync = False
        try:
            yield
        finally:
            self._ddp.require_sync = previous

    @property
    def require_backward_grad_sync(self) -> bool:
        """torch DDP's flag, the one `no_sync()` sets: False makes backward accumulate locally (nanoGPT sets it to
        `micro_step == last` instead of entering no_sync)."""
        return self._ddp.require_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._ddp.require_sync = bool(value)

    def sync_gradients(self) -> None:
        """All-reduce, now, the gradients that backward passes under `no_sync()` accumulated (collective): a
        pipeline calls it once per step, after its last microbatch."""
        self._ddp.sync_now()

    @property
    def compressor(self) -> Compressor | None:
        """This rank's gradient compressor (with its error-feedback state), or None: `state_dict()` saves it."""
        return self._ddp.compressor

    def ddp_buckets(self) -> list[dict[str, Any]]:
        """The bucket layout: for each bucket in launch order, its parameter names and bytes."""
        names = self._ddp.names
        return [{"params": [names[p] for p in b.params], "bytes": b.nbytes} for b in self._ddp.buckets]


def DDP(
    module: nn.Module,
    comm: Communicator,
    *,
    bucket_mb: float = 25,
    first_bucket_mb: float = 1,
    find_unused_parameters: bool = False,
    broadcast_buffers: bool = True,
    compression: Compressor | None = None,
    batch_norm: str | None = None,
    buffer_writes: str | None = None,
    forward_methods: tuple[str, ...] | None = None,
) -> nn.Module:
    """Make `module` data parallel over `comm` and return it (the same object, its parameter names unchanged).

    bucket_mb: size of the gradient buckets (MiB) that are all-reduced as units; bigger means fewer collectives,
        smaller means earlier overlap. first_bucket_mb: size of the first bucket (the last layers' gradients).
    find_unused_parameters: allow parameters that get no gradient in some iterations (see the module docstring).
    broadcast_buffers: broadcast rank 0's buffers (e.g. BatchNorm statistics) before every forward.
    compression: a `sw.compression` method (e.g. `sw.compression.PowerSGD(rank=4)`) that reduces each bucket
        instead of the fp32 all-reduce; None (default) keeps the exact average.
    batch_norm: "sync" (BatchNorm layers become sw.SyncBatchNorm over `comm`: the global batch's statistics),
        "local" (each rank's own, torch DDP's), None (default: a forward that would use per-rank batch statistics
        raises, naming the layer; batch_norm_split.py).
    buffer_writes: None (default: a buffer that a training forward leaves different across the ranks, such as a
        running statistic of each rank's slice, raises, naming it) or "local" (each rank's own, torch DDP's;
        buffer_writes.py).
    forward_methods: names of the model's methods called instead of its forward (CLIP's "encode_image"): each runs
        as the forward, through its hooks (forward_methods.py; needed under ZeRO / FSDP, accepted here alike).
    Train it with any torch.optim optimizer over `module.parameters()`; use `module.no_sync()` to accumulate.
    """
    if not isinstance(module, nn.Module):
        raise ValueError(f"DDP: module must be a torch.nn.Module, got {type(module).__name__}")
    refuse_compiled(module, "sw.DDP")
    if not is_communicator(comm):
        raise ValueError(f"DDP: comm must be a shardwise Communicator (sw.init(), sw.launch's argument, mesh.dp), "
                         f"got {type(comm).__name__}")
    for name, value in (("find_unused_parameters", find_unused_parameters), ("broadcast_buffers", broadcast_buffers)):
        if not isinstance(value, bool):
            raise ValueError(f"DDP: {name}={value!r} must be True or False")
    if compression is not None and not isinstance(compression, Compressor):
        raise ValueError(f"DDP: compression={compression!r} must be None or a sw.compression method (FP16(), BF16(), "
                         f"TopK(ratio), RandomK(ratio), PowerSGD(rank), OneBit())")
    layout.check_not_data_parallel(module, "DDP")
    refuse_unsplittable_batch_statistics(module, comm, "DDP")
    apply_batch_norm_choice(module, comm, batch_norm, "DDP")
    check_buffer_writes_option(buffer_writes, "DDP")
    methods = check_forward_methods(module, forward_methods, "DDP")
    check_embedding_rows(module, comm, "DDP")
    check_copies(module, compression, "DDP")
    for name, value in (("bucket_mb", bucket_mb), ("first_bucket_mb", first_bucket_mb)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"DDP: {name}={value!r} must be a positive number of MiB")
    to_comm_device(module, comm, "DDP")  # NCCL broadcasts and reduces CUDA tensors: the model goes to comm.device
    before = layout.placements(module)
    try:  # experts split over ranks of comm (expert parallel) are averaged over their replicas only
        groups = {id(pl.param): data_parallel_group(pl, comm) for pl in before.values()}
    except ValueError as e:
        raise ValueError(f"DDP: {e}") from None
    if compression is not None and any(g is not comm for g in groups.values()):
        raise ValueError("DDP: compression with expert-parallel parameters is not supported yet; use compression=None")
    check_agreement(comm, "DDP", {"parameters": describe_parameters(module), "options": {
        "bucket_mb": bucket_mb, "first_bucket_mb": first_bucket_mb, "find_unused_parameters": find_unused_parameters,
        "broadcast_buffers": broadcast_buffers, "batch_norm": batch_norm, "buffer_writes": buffer_writes,
        "forward_methods": methods,
        "compression": None if compression is None else compression.config()}})
    if comm.size > 1:
        broadcast_coalesced(comm, [local(p.data) for p in module.parameters() if groups.get(id(p), comm) is comm]
                            + [b.data for b in module.buffers()])
    reducer = Reducer(module, comm, bucket_mb, first_bucket_mb, find_unused_parameters, broadcast_buffers,
                       compression, groups)
    route_through_forward(module, methods)  # before DDPModule: its forward then wraps the routed method too
    mix_in(module, DDPModule, "DDP")
    module._ddp = reducer
    layout.declare(module, layout.Parallelized(
        "ddp", (comm,),
        {name: dataclasses.replace(pl, replicated_over=(*pl.replicated_over, comm)) if groups[id(pl.param)] is comm
         else pl for name, pl in before.items()},
        no_sync=module.no_sync, world=comm,
        memory=lambda: layout.MemoryView(grads=tuple(b.buffer for b in reducer.buckets)),
        options={"bucket_mb": bucket_mb, "first_bucket_mb": first_bucket_mb},
        # The compressor's residuals are per rank and per bucket: valid only under the same bucket layout.
        extra_state=() if reducer.compressor is None else (reducer.compressor.extra_state(
            comm, buckets=[b.buffer.numel() for b in reducer.buckets]),),
        before_step=reducer.check_averaged if comm.size > 1 else None))
    watch_buffer_writes(module, comm, buffer_writes, "DDP")
    share_batch_split(module, comm, "DDP")  # a MoE layer's balance loss over the global batch (batch_split.py)
    register_wrapped(module)
    log.debug("DDP over %d ranks: %d buckets %s", comm.size, len(reducer.buckets), [b.nbytes for b in reducer.buckets])
    return module

