"""The engine of `sw.DDP` (ddp.py): gradient buckets, the per-parameter ready hooks, the end-of-backward callback.

`Reducer` packs a module's trainable parameters into flat buckets (reverse registration order; the first one small),
makes each `.grad` a view into its bucket, launches a bucket's all-reduce (or its compressor) as soon as its last
gradient is ready and every earlier bucket is launched (index order on every rank), and waits for all of them in a
callback queued on the autograd engine, so `loss.backward()` returns with averaged gradients (Li et al., VLDB 2020).
With `find_unused_parameters` it marks unreachable parameters ready at the start of backward and agrees with the
other ranks on which were used anywhere (unused.py). ddp.py's module docstring describes the whole mechanism.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .agreement import agree_on_recovery
from .comm.base import Communicator, ReduceOp, Work
from .comm.coalesced import broadcast_coalesced
from .compression.base import Compressor
from .graph_gradients import average_when_building_graph, refuse_graph_accumulation
from .param_hooks import hold_back_hooks, internal_hook
from .profiler_ranges import profiler_range
from .sharded_tensor import grad_like, local
from .unused import used_anywhere

__all__ = ["Bucket", "Reducer", "reachable_parameters", "MB"]

log = logging.getLogger("shardwise.ddp")
MB = 1024 * 1024


class Bucket:
    """A flat gradient buffer shared by a run of parameters of one dtype, device and reduction group."""

    def __init__(self, index: int, params: list[nn.Parameter], comm: Communicator | None) -> None:
        self.index = index
        self.params = params
        self.comm = comm  # the group it is averaged over (None: nothing to average, see replica_groups.data_parallel_group)
        pieces = [local(p) for p in params]  # a tensor-parallel slice's own storage (sharded_tensor.py)
        numel = sum(p.numel() for p in pieces)
        self.buffer = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
        self.views: list[torch.Tensor] = []  # the bucket's own, never handed out
        offset = 0
        for piece in pieces:
            self.views.append(self.buffer[offset : offset + piece.numel()].view_as(piece))
            offset += piece.numel()
        # what each parameter's .grad is: an alias of its view (see grad)
        self.grads: list[torch.Tensor] = [self._alias(i) for i in range(len(params))]
        self.pending = len(params)
        self.work: Work | None = None

    def grad(self, i: int) -> torch.Tensor:
        """Parameter i's gradient to hand out: a tensor object of its own aliasing the bucket's view, so a script's
        `p.grad.data = p.grad.data * 0.5` (old-style in-place edits, `nn.utils.vector_to_parameters` over the
        gradients) re-points that object and never the view the bucket reduces. Handed out again after such an edit,
        a fresh alias (the edited object no longer views the bucket: it would be missed by the all-reduce)."""
        if local(self.grads[i]).data_ptr() != self.views[i].data_ptr():
            self.grads[i] = self._alias(i)
        return self.grads[i]

    def _alias(self, i: int) -> torch.Tensor:
        """A new tensor object viewing parameter i's slice of the buffer (a sharded one answering for the whole)."""
        return grad_like(self.views[i].view_as(self.views[i]), self.params[i])

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


class Reducer:
    """Per-model DDP state: buckets, hooks, and the bookkeeping of the backward pass in flight."""

    def __init__(self, module: nn.Module, comm: Communicator, bucket_mb: float, first_bucket_mb: float,
                 find_unused_parameters: bool, broadcast_buffers: bool, compression: Compressor | None = None,
                 groups: dict[int, Communicator | None] | None = None) -> None:
        self.comm = comm
        # Per parameter, the ranks it is averaged over: comm, or for experts split over ranks of comm their replicas
        # (replica_groups.data_parallel_group); those with no replica in comm are left alone.
        self.groups = {id(p): (groups or {}).get(id(p), comm) for p in module.parameters()}
        self.compressor = compression.fresh() if compression is not None else None  # this rank's own state
        self.find_unused = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.require_sync = True
        self.names = {p: n for n, p in module.named_parameters()}
        self.bucket_mb, self.first_bucket_mb = bucket_mb, first_bucket_mb
        # Every parameter DDP averages, with the requires_grad it has been following (follow_requires_grad).
        self.averaged = [p for p in module.parameters() if self.groups[id(p)] is not None]
        self.hooks: list[Any] = []
        self._layout()
        self.buffers = list(module.buffers())
        self.reachable: set[nn.Parameter] = set()
        # Forwards whose backward has not ended yet: a pipeline runs several before the first backward, so the
        # parameters reachable from any of them must not be marked unused until all their backwards are done.
        self.outstanding_forwards = 0
        self.failed = False  # a forward raised: recover before the next one
        self._reset()

    # ---- layout -----------------------------------------------------------------------------------------------
    def _layout(self) -> None:
        """Buckets and gradient hooks for the parameters that require grad now."""
        for hook in self.hooks:
            hook.remove()
        self.following = [p.requires_grad for p in self.averaged]
        self.params = [p for p in self.averaged if p.requires_grad]
        self.buckets = self._make_buckets(self.bucket_mb, self.first_bucket_mb)
        self.location = {p: (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        ready = internal_hook(lambda param: self._on_grad_ready(param))  # DDP's own: never held back (HeldBack)
        self.hooks = [p.register_post_accumulate_grad_hook(ready) for p in self.params]
        # torch.autograd.grad(..., create_graph=True) gets the data-parallel average (graph_gradients.py)
        self.hooks += [p.register_hook(internal_hook(average_when_building_graph((self.groups[id(p)],))))
                       for p in self.params]

    def follow_requires_grad(self) -> None:
        """A script that froze or unfroze parameters since the last forward (gradual unfreezing, a frozen
        backbone): buckets and hooks are rebuilt for the parameters that require grad now, so a frozen one gets no
        gradient and keeps its `.grad` and an unfrozen one is averaged, as in one process. A `.grad` that views an
        old bucket keeps it alive and is copied into the new one at the next backward. Refused within an
        accumulation (part of the step's gradient would be averaged and part not) and under compression (its
        error-feedback residuals are laid out per bucket)."""
        with torch._C.DisableTorchFunctionSubclass():  # tensor-parallel slices: a plain read, once per forward
            if all(p.requires_grad is f for p, f in zip(self.averaged, self.following)):
                return
        names = [self.names[p] for p, f in zip(self.averaged, self.following) if p.requires_grad is not f]
        if self.unsynced:
            raise ValueError(f"DDP: requires_grad of {names[:8]} changed between backward passes accumulated under "
                             f"no_sync(); freeze or unfreeze parameters after the optimizer step, before the next "
                             f"step's first forward")
        if self.compressor is not None:
            raise ValueError(f"DDP: requires_grad of {names[:8]} changed after wrapping with compression, whose "
                             f"error-feedback state is laid out per gradient bucket; set requires_grad before "
                             f"wrapping")
        self._layout()
        self._reset()
        log.debug("DDP: requires_grad changed (%s): %d buckets rebuilt", names[:8], len(self.buckets))

    def _make_buckets(self, bucket_mb: float, first_bucket_mb: float) -> list[Bucket]:
        buckets: list[Bucket] = []
        current: list[nn.Parameter] = []
        size = 0
        for p in reversed(self.params):
            limit = (first_bucket_mb if not buckets else bucket_mb) * MB
            if current and (size >= limit or (p.dtype, p.device, self.groups[id(p)]) !=
                            (current[0].dtype, current[0].device, self.groups[id(current[0])])):
                buckets.append(Bucket(len(buckets), current, self.groups[id(current[0])]))
                current, size = [], 0
            current.append(p)
            size += local(p).numel() * p.element_size()
        if current:
            buckets.append(Bucket(len(buckets), current, self.groups[id(current[0])]))
        return buckets

    def _reset(self) -> None:
        for b in self.buckets:
            b.pending = len(b.params)
            b.work = None
        self.marked: set[nn.Parameter] = set()
        self.used: set[nn.Parameter] = set()
        self.unsynced = False  # gradients of backward passes under no_sync() wait for their all-reduce
        self.next_bucket = 0
        self.in_backward = False
        self.held_calls: list[tuple[Any, nn.Parameter]] = []  # the user's gradient hooks, held back (HeldBack)

    # ---- forward side -----------------------------------------------------------------------------------------
    def before_forward(self) -> None:
        if self.failed or (self.in_backward and torch._C._current_graph_task_id() == -1):
            self._recover()
        self.follow_requires_grad()
        hold_back_hooks(self.params, self._holding)
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
            self.reachable |= reachable_parameters(output)
            self.outstanding_forwards += 1

    # ---- backward side ----------------------------------------------------------------------------------------
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        refuse_graph_accumulation("DDP", self.names[param])
        if not self.require_sync:
            self.unsynced = True
            return  # no_sync(): let gradients accumulate locally
        if not self.in_backward:
            if self.find_unused and not self.outstanding_forwards:  # every parameter would look unused
                raise RuntimeError(
                    f"DDP(find_unused_parameters=True): a backward reached {self.names[param]!r} after no forward of "
                    f"the wrapped model: a method called instead of the forward (CLIP's encode_image) is declared "
                    f"with forward_methods=('encode_image', ...); a forward run under no_sync() has its backward "
                    f"under it too")
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

    def _holding(self) -> list[tuple[Any, nn.Parameter]] | None:
        """Where a user's gradient hook records its call: held back until the gradients are averaged in a
        synchronised backward (param_hooks.HeldBack); None under no_sync(), where it runs at once as in torch DDP."""
        return self.held_calls if self.require_sync else None

    def _mark_ready(self, param: nn.Parameter, *, used: bool) -> None:
        bucket, i = self.location[param]
        view = bucket.views[i]
        grad = param.grad
        if grad is None:
            view.zero_()
        elif local(grad).data_ptr() != view.data_ptr():
            view.copy_(local(grad))
            param.grad = bucket.grad(i)
        self.marked.add(param)
        if used:
            self.used.add(param)
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
            bucket = self.buckets[self.next_bucket]
            with profiler_range("ddp_all_reduce", ("bucket", bucket.index)):  # the name is formatted only if recorded
                if self.compressor is not None:
                    bucket.work = self.compressor.reduce(bucket.index, bucket.buffer, self.comm,
                                                         [local(p).shape for p in bucket.params])
                else:
                    bucket.work = bucket.comm.all_reduce(bucket.buffer, ReduceOp.AVG, async_op=True)
            self.next_bucket += 1

    def _finish_backward(self) -> None:
        with profiler_range("ddp_finish_backward"):
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
                for hook, param in self.held_calls:  # the user's gradient hooks, on averaged gradients
                    hook.release(param)
            finally:
                self.outstanding_forwards = max(0, self.outstanding_forwards - 1)
                if self.outstanding_forwards == 0:
                    self.reachable = set()
                self._reset()

    def check_averaged(self, held: set[int]) -> None:
        """Before an optimizer over the parameters `held` (ids) steps: each gradient must be the one DDP averaged,
        in its bucket, where the last synchronised backward handed it out (changed in place, or its `.data`
        re-pointed by the script: the object handed out, Bucket.grad). One set
        otherwise (`p.grad = g` from torch.autograd.grad, which runs no gradient hook; backward passes only under
        no_sync()) is this rank's alone, and the replicas would step apart, silently: a RuntimeError naming it."""
        if self.unsynced and any(id(p) in held for p in self.params):  # accumulated in the buckets, in place
            raise RuntimeError(f"optimizer.step(): the gradients of the backward passes since the last synchronised "
                               f"one ran under no_sync() (or require_backward_grad_sync=False) and were never "
                               f"averaged over the {self.comm.size} ranks, so each rank would step on its own; run "
                               f"the last micro-batch's backward outside no_sync(), or call model.sync_gradients() "
                               f"before the step")
        with torch._C.DisableTorchFunctionSubclass():  # tensor-parallel slices: a plain attribute read
            for bucket in self.buckets:
                for p, view, handed in zip(bucket.params, bucket.views, bucket.grads):
                    grad = p.grad  # the bucket's view, or a tensor re-describing it (a pipeline stage's gradient)
                    if (id(p) in held and grad is not None and grad is not handed and grad.data_ptr() != view.data_ptr()
                            and view.numel()):
                        raise RuntimeError(
                            f"optimizer.step(): the gradient of {self.names[p]!r} is not one DDP averaged over the "
                            f"{self.comm.size} ranks (it was set outside loss.backward(): torch.autograd.grad and an "
                            f"assignment to .grad run no DDP hook, and backward passes under no_sync() accumulate "
                            f"locally), so each rank would step on its own; call loss.backward() (outside no_sync() "
                            f"for the last micro-batch) and change gradients in place (p.grad.mul_(...)), or "
                            f"all-reduce them yourself over the DDP group before the step")

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
                p.grad = bucket.grad(i)


def reachable_parameters(output: Any) -> set[nn.Parameter]:
    """Leaf parameters reachable from the autograd graph of every tensor in `output` (nested lists/dicts too)."""
    roots = [t.grad_fn for t in tensors_in(output) if t.grad_fn is not None]
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


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v)
