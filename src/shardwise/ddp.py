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
  (`layout.data_parallel_group`).
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

import torch
from torch import nn

from . import layout
from ._mixin import MovesRefused, mix_in
from .agreement import agree_on_recovery, check_agreement, describe_parameters
from .comm.base import Communicator, ReduceOp, Work, is_communicator
from .comm.coalesced import broadcast_coalesced
from .compression.base import Compressor
from .compression.support import check_copies
from .optimizer_guard import register_wrapped
from .batch_split import share_batch_split
from .compiled import refuse_compiled
from .placement import to_comm_device
from .sharded_tensor import grad_like, local
from .unused import used_anywhere

__all__ = ["DDP", "DDPModule"]

log = logging.getLogger("shardwise.ddp")
MB = 1024 * 1024


class _Bucket:
    """A flat gradient buffer shared by a run of parameters of one dtype, device and reduction group."""

    def __init__(self, index: int, params: list[nn.Parameter], comm: Communicator | None) -> None:
        self.index = index
        self.params = params
        self.comm = comm  # the group it is averaged over (None: nothing to average, see layout.data_parallel_group)
        pieces = [local(p) for p in params]  # a tensor-parallel slice's own storage (sharded_tensor.py)
        numel = sum(p.numel() for p in pieces)
        self.buffer = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
        self.views: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []  # the views as each parameter's .grad (answering for the whole, if sliced)
        offset = 0
        for p, piece in zip(params, pieces):
            view = self.buffer[offset : offset + piece.numel()].view_as(piece)
            self.views.append(view)
            self.grads.append(grad_like(view, p))
            offset += piece.numel()
        self.pending = len(params)
        self.work: Work | None = None

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


class _Reducer:
    """Per-model DDP state: buckets, hooks, and the bookkeeping of the backward pass in flight."""

    def __init__(self, module: nn.Module, comm: Communicator, bucket_mb: float, first_bucket_mb: float,
                 find_unused_parameters: bool, broadcast_buffers: bool, compression: Compressor | None = None,
                 groups: dict[int, Communicator | None] | None = None) -> None:
        self.comm = comm
        # Per parameter, the ranks it is averaged over: comm, or for experts split over ranks of comm their replicas
        # (layout.data_parallel_group); those with no replica in comm are left alone.
        self.groups = {id(p): (groups or {}).get(id(p), comm) for p in module.parameters()}
        self.compressor = compression.fresh() if compression is not None else None  # this rank's own state
        self.find_unused = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.require_sync = True
        self.names = {p: n for n, p in module.named_parameters()}
        self.params = [p for p in module.parameters() if p.requires_grad and self.groups[id(p)] is not None]
        self.buffers = list(module.buffers())
        self.buckets = self._make_buckets(bucket_mb, first_bucket_mb)
        self.location = {p: (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]
        self.reachable: set[nn.Parameter] = set()
        # Forwards whose backward has not ended yet: a pipeline runs several before the first backward, so the
        # parameters reachable from any of them must not be marked unused until all their backwards are done.
        self.outstanding_forwards = 0
        self.failed = False  # a forward raised: recover before the next one
        self._reset()

    # ---- layout -----------------------------------------------------------------------------------------------
    def _make_buckets(self, bucket_mb: float, first_bucket_mb: float) -> list[_Bucket]:
        buckets: list[_Bucket] = []
        current: list[nn.Parameter] = []
        size = 0
        for p in reversed(self.params):
            limit = (first_bucket_mb if not buckets else bucket_mb) * MB
            if current and (size >= limit or (p.dtype, p.device, self.groups[id(p)]) !=
                            (current[0].dtype, current[0].device, self.groups[id(current[0])])):
                buckets.append(_Bucket(len(buckets), current, self.groups[id(current[0])]))
                current, size = [], 0
            current.append(p)
            size += local(p).numel() * p.element_size()
        if current:
            buckets.append(_Bucket(len(buckets), current, self.groups[id(current[0])]))
        return buckets

    def _reset(self) -> None:
        for b in self.buckets:
            b.pending = len(b.params)
            b.work = None
        self.marked: set[nn.Parameter] = set()
        self.used: set[nn.Parameter] = set()
        self.next_bucket = 0
        self.in_backward = False

    # ---- forward side -----------------------------------------------------------------------------------------
    def before_forward(self) -> None:
        if self.failed or (self.in_backward and torch._C._current_graph_task_id() == -1):
            self._recover()
        if self.broadcast_buffers and self.buffers and self.comm.size > 1:
            broadcast_coalesced(self.comm, [b.data for b in self.buffers])

    def sync_now(self) -> None:
        """All-reduce every bucket now (what backward passes under no_sync accumulated); every .grad views its
        bucket afterwards, except a parameter no rank used (find_unused_parameters=True), which keeps None."""
        self._check_all_used([p for p in self.params if p.grad is None])
        for p in self.params:
            self._mark_ready(p, used=p.grad is not None)  # launches each bucket as it fills, in bucket order
        used_flags = self._start_used_flags()
        for bucket in self.buckets:
            assert bucket.work is not None
            bucket.work.wait()
        self._hand_out_grads(used_flags)
        self._reset()

    def _recover(self) -> None:
        """The previous backward raised before its end-of-backward callback ran: wait for the buckets it launched
        (every rank launched them, in order), then start clean (the partial gradients are the caller's to zero)."""
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
        agree_on_recovery(self.comm, "DDP")
        self.reachable = set()
        self.outstanding_forwards = 0
        self.failed = False
        self._reset()

    def after_forward(self, output: Any) -> None:
        if self.find_unused and self.require_sync and torch.is_grad_enabled():
            # The union over the outstanding forwards: a parameter outside it gets no gradient in any of their
            # backwards, so marking it ready early is safe; one inside it is marked at the end of backward if unused.
            self.reachable |= _reachable_parameters(output)
            self.outstanding_forwards += 1

    # ---- backward side ----------------------------------------------------------------------------------------
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self.require_sync:
            return  # no_sync(): let gradients accumulate locally
        if not self.in_backward:
            self.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            if self.find_unused:
                for p in self.params:
                    if p not in self.reachable and p is not param:
                        self._mark_ready(p, used=p.grad is not None)
        if param in self.marked:
            raise RuntimeError(
                f"DDP: parameter {self.names[param]!r} received its gradient twice in one backward pass. This "
                f"happens with reentrant activation checkpointing or a module used in two backward passes; use "
                f"torch.utils.checkpoint(..., use_reentrant=False)"
            )
        self._mark_ready(param, used=True)

    def _mark_ready(self, param: nn.Parameter, *, used: bool) -> None:
        bucket, i = self.location[param]
        view = bucket.views[i]
        grad = param.grad
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr():
            view.copy_(local(grad))
            param.grad = bucket.grads[i]
        self.marked.add(param)
        if used:
            self.used.add(param)
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
            bucket = self.buckets[self.next_bucket]
            if self.compressor is not None:
                bucket.work = self.compressor.reduce(bucket.index, bucket.buffer, self.comm,
                                                     [local(p).shape for p in bucket.params])
            else:
                bucket.work = bucket.comm.all_reduce(bucket.buffer, ReduceOp.AVG, async_op=True)
            self.next_bucket += 1

    def _finish_backward(self) -> None:
        try:
            missing = [p for p in self.params if p not in self.marked]
            self._check_all_used(missing)
            for p in missing:
                self._mark_ready(p, used=p.grad is not None)
            used_flags = self._start_used_flags()
            for bucket in self.buckets:
                assert bucket.work is not None
                bucket.work.wait()
            self._hand_out_grads(used_flags)
        finally:
            self.outstanding_forwards = max(0, self.outstanding_forwards - 1)
            if self.outstanding_forwards == 0:
                self.reachable = set()
            self._reset()

    def _check_all_used(self, missing: list[nn.Parameter]) -> None:
        """Without find_unused_parameters, a trainable parameter with no gradient is an error naming it."""
        if missing and not self.find_unused:
            names = [self.names[p] for p in missing]
            raise RuntimeError(
                f"DDP: {len(names)} trainable parameter(s) got no gradient in this backward pass: {names[:8]}"
                f"{' ...' if len(names) > 8 else ''}. Their bucket would never be reduced. Pass "
                f"find_unused_parameters=True to DDP (to sw.parallelize or sw.distribute), or set requires_grad=False "
                f"on parameters you do not train")

    def _start_used_flags(self) -> list[bool] | None:
        """With find_unused_parameters: which parameters some rank used (one small all-reduce of flags)."""
        if not self.find_unused:
            return None
        return used_anywhere([p in self.used for p in self.params], [self.comm], self.comm.device)

    def _hand_out_grads(self, used: list[bool] | None) -> None:
        """Every .grad views its bucket, but a parameter unused on every rank keeps None, as in one process."""
        for p, was_used in zip(self.params, used if used is not None else [True] * len(self.params)):
            if not was_used:
                p.grad = None
            else:
                bucket, i = self.location[p]
                p.grad = bucket.grads[i]


def _reachable_parameters(output: Any) -> set[nn.Parameter]:
    """Leaf parameters reachable from the autograd graph of every tensor in `output` (nested lists/dicts too)."""
    roots = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
    seen, found = set(), set()
    while roots:
        fn = roots.pop()
        if fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)
        if variable is not None:
            found.add(variable)
        roots.extend(next_fn for next_fn, _ in fn.next_functions if next_fn is not None)
    return found


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


class DDPModule(MovesRefused):
    """Mixed into a module's class by `DDP`: adds `no_sync()` and the forward-time buffer broadcast."""

    _ddp: _Reducer

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
) -> nn.Module:
    """Make `module` data parallel over `comm` and return it (the same object, its parameter names unchanged).

    bucket_mb: size of the gradient buckets (MiB) that are all-reduced as units; bigger means fewer collectives,
        smaller means earlier overlap. first_bucket_mb: size of the first bucket (the last layers' gradients).
    find_unused_parameters: allow parameters that get no gradient in some iterations (see the module docstring).
    broadcast_buffers: broadcast rank 0's buffers (e.g. BatchNorm statistics) before every forward.
    compression: a `sw.compression` method (e.g. `sw.compression.PowerSGD(rank=4)`) that reduces each bucket
        instead of the fp32 all-reduce; None (default) keeps the exact average.
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
    check_copies(module, compression, "DDP")
    for name, value in (("bucket_mb", bucket_mb), ("first_bucket_mb", first_bucket_mb)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"DDP: {name}={value!r} must be a positive number of MiB")
    to_comm_device(module, comm, "DDP")  # NCCL broadcasts and reduces CUDA tensors: the model goes to comm.device
    before = layout.placements(module)
    try:  # experts split over ranks of comm (expert parallel) are averaged over their replicas only
        groups = {id(pl.param): layout.data_parallel_group(pl, comm) for pl in before.values()}
    except ValueError as e:
        raise ValueError(f"DDP: {e}") from None
    if compression is not None and any(g is not comm for g in groups.values()):
        raise ValueError("DDP: compression with expert-parallel parameters is not supported yet; use compression=None")
    check_agreement(comm, "DDP", {"parameters": describe_parameters(module), "options": {
        "bucket_mb": bucket_mb, "first_bucket_mb": first_bucket_mb, "find_unused_parameters": find_unused_parameters,
        "broadcast_buffers": broadcast_buffers,
        "compression": None if compression is None else compression.config()}})
    if comm.size > 1:
        broadcast_coalesced(comm, [p.data for p in module.parameters() if groups.get(id(p), comm) is comm]
                            + [b.data for b in module.buffers()])
    reducer = _Reducer(module, comm, bucket_mb, first_bucket_mb, find_unused_parameters, broadcast_buffers,
                       compression, groups)
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
            comm, buckets=[b.buffer.numel() for b in reducer.buckets]),)))
    share_batch_split(module, comm)  # a MoE layer's balance loss over the global batch (batch_split.py)
    register_wrapped(module)
    log.debug("DDP over %d ranks: %d buckets %s", comm.size, len(reducer.buckets), [b.nbytes for b in reducer.buckets])
    return module

