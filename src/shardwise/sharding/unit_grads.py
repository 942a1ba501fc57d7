"""The gradient half of a sharding unit: flat gradient buffer, used flags, reduce-scatter, `.grad` hand-off.

A mixin of `Unit` (unit.py has the parameter half and the layout both share). Per backward: `accumulate_grad`
copies (or, under no_sync, adds) each unsharded gradient into the unit's flat gradient buffer as autograd produces
it; `start_reduce` zeroes what no gradient wrote, writes the used flags (`grad_layout`) and launches the
reduce-scatter (AVG), or the compressed reduction; `finish_reduce` waits, all-reduces over the replicate group
(hybrid sharding), and hands each trainable parameter that some rank used its piece of the averaged shard as
`.grad`; a parameter no rank used keeps its `.grad` (None after zero_grad), as in one process.
In a shard group of one nothing is reduced: the flat buffer is the averaged shard (no collective, no copy), and with
no replicas, no compression and gradients in the master's dtype (`direct_grads`) there is no buffer at all: the
tensors autograd produced become the shard parameters' `.grad`, as in plain PyTorch.
"""

from __future__ import annotations

import functools

import torch
from torch._utils import _unflatten_dense_tensors

from ..comm.base import CompletedWork, ReduceOp
from ..comm.labels import collective_label
from ..param_hooks import has_gradient_hooks, run_gradient_hooks
from ..sharded_tensor import as_sharded, grad_like, is_sharded, local, spec_of
from .param_info import ParamInfo

__all__ = ["UnitGradients"]


class UnitGradients:
    """Mixed into `Unit`; uses its layout (infos, trainable, shard sizes, groups) and its gather state."""

    def begin_backward(self) -> None:
        self.grad_pending = len(self.trainable)
        self.grads_seen: set[str] = set()
        self.reduce_started = False  # this backward's reduce-scatter of the unit was launched

    def prepare_grad_views(self) -> None:
        """Before the unit's backward: make each unsharded parameter's `.grad` a view of its slice of the flat
        gradient buffer, so autograd accumulates straight into the buffer (`AccumulateGrad` adds in place into a
        defined `.grad`) and the per-parameter hook only counts: no copy and no tensor work in Python per parameter
        (PyTorch DDP's `gradient_as_bucket_view`). Possible where the gradient has the buffer's dtype and its slice
        is contiguous (it crosses no flag band); the others keep the copy in `accumulate_grad`. The buffer is zeroed
        in one fill at the start of a cycle; a slice an earlier backward of the cycle wrote (under no_sync) keeps its
        sum, to which autograd adds."""
        if self.grad_views or not self.trainable or self.reduce_dtype != self.param_dtype or self.direct_grads:
            return
        self._ready_grad_buffer()
        assert self.grad_buffer is not None
        if not self.grads_written and not self.grad_buffer_zeroed:
            self.grad_buffer.zero_()
            self.grad_buffer_zeroed = True
        for info, view in self._cut_views(self.grad_buffer):
            if info.name in self.grads_seen:
                continue  # its gradient of this pass was copied in already
            if not self.grad_buffer_zeroed and info.name not in self.grads_written:
                view.zero_()  # the buffer was not filled with zeros this cycle (a gradient was copied in first)
            info.unsharded.grad = view
            self.grad_views[info.name] = (info, view)

    def _cut_views(self, flat: torch.Tensor) -> list[tuple[ParamInfo, torch.Tensor]]:
        """Each parameter of `_view_groups` with its slice of `flat` in its own shape. One C++ call per group (a
        Python slice and view per parameter cost ~3x more host time)."""
        out: list[tuple[ParamInfo, torch.Tensor]] = []
        for at, infos in self._view_groups():
            numel = sum(info.numel for info in infos)
            out += zip(infos, _unflatten_dense_tensors(flat[at : at + numel], [info.unsharded for info in infos]))
        return out

    def _whole_views(self, shard: torch.Tensor) -> dict[str, torch.Tensor]:
        """Whole pieces (a shard group of one): each parameter's averaged gradient in its own shape, by name (one
        chunk, so a buffer offset of `_view_groups` is the data offset in the shard)."""
        assert self.shard_comm.size == 1
        return {info.name: view for info, view in self._cut_views(shard)}

    def _view_groups(self) -> list[tuple[int, list[ParamInfo]]]:
        """Runs of trainable parameters whose gradients lie back to back in the flat buffer, as (buffer offset,
        parameters); a parameter crossing a flag band is in none (its gradient is copied). Fixed by the layout."""
        if self.grad_view_groups is None:
            groups: list[tuple[int, list[ParamInfo]]] = []
            end = -1
            for info in self.trainable:
                runs = self.grad_layout.runs(info.offset, info.numel)
                if len(runs) != 1:
                    end = -1
                    continue
                at = runs[0][0]
                if at == end:
                    groups[-1][1].append(info)
                else:
                    groups.append((at, [info]))
                end = at + info.numel
            self.grad_view_groups = groups
        return self.grad_view_groups

    def _drop_grad_views(self) -> None:
        """The unsharded parameters let go of the buffer (before it becomes the reduction's scratch, or is freed)."""
        for info, view in self.grad_views.values():
            if info.unsharded.grad is view:
                info.unsharded.grad = None
        self.grad_views = {}

    def refuse_late_gradient(self, who: str, info: ParamInfo) -> None:
        """Raise when a parameter's gradient arrives after this backward's reduce-scatter of the unit was launched:
        its module ran in a second backward pass of the step, whose part of the gradient the reduction missed."""
        if self.reduce_started and info.name in self.grads_seen:
            raise RuntimeError(
                f"{who}: parameter {info.name!r} received a gradient after its unit's gradients were reduced in this "
                f"backward pass: its module ran in two backward passes of one step, as reentrant activation "
                f"checkpointing (torch.utils.checkpoint(..., use_reentrant=True), or HuggingFace's "
                f"gradient_checkpointing_enable with use_reentrant=True) runs each checkpointed call of a module used "
                f"more than once per forward (a looped or recurrent block); this part of its gradient would be lost. "
                f"Use use_reentrant=False (HuggingFace: gradient_checkpointing_kwargs={{'use_reentrant': False}}) or "
                f"shardwise's activation_checkpointing=")

    def accumulate_grad(self, info: ParamInfo) -> None:
        """Count a parameter's gradient of this pass; unless autograd accumulated it straight into the flat buffer
        (`prepare_grad_views`), add it there (the buffer allocated on first use)."""
        grad = info.unsharded.grad
        if self.direct_grads:
            pass  # the gradient stays where autograd put it (and adds the next backward's) until finish_reduce
        elif self._grad_is_view(info):
            self.grads_written.add(info.name)
        elif grad is not None:
            self._ready_grad_buffer()
            flat = grad.reshape(-1)
            again = info.name in self.grads_written
            for at, src, n in self.grad_layout.runs(info.offset, info.numel):
                piece, values = self.grad_buffer[at : at + n], flat[src : src + n]
                if again:
                    piece.add_(values)  # a second backward under no_sync(): accumulate
                else:
                    piece.copy_(values)  # first of the cycle: the buffer was never zeroed for it
            self.grads_written.add(info.name)
            info.unsharded.grad = None  # the flat buffer holds it now; free the unsharded gradient
        self._count_seen(info)

    def flush_unused(self) -> None:
        """End of backward: parameters whose hook never fired contribute zeros (or a gradient left on them); a
        parameter whose `.grad` is still the untouched buffer view got none this pass."""
        for info in self.trainable:
            if info.name in self.grads_seen:
                continue
            if self._grad_is_view(info):
                self._count_seen(info)
            else:
                self.accumulate_grad(info)

    def _grad_is_view(self, info: ParamInfo) -> bool:
        """Whether the unsharded parameter's `.grad` is still its view of the flat buffer (`prepare_grad_views`)."""
        viewed = self.grad_views.get(info.name)
        return viewed is not None and info.unsharded.grad is viewed[1]

    def _count_seen(self, info: ParamInfo) -> None:
        """This pass's arrival of the parameter's gradient, once: the unit reduces when none is pending."""
        if info.name not in self.grads_seen:
            self.grads_seen.add(info.name)
            self.grad_pending -= 1

    def start_reduce(self) -> None:
        """Reduce-scatter (AVG) the flat gradient buffer into this rank's shard, asynchronously; its collectives are
        named after the unit, so ranks reducing different units of one size at one position raise instead of
        summing one unit's gradients into the other's (comm/labels.py)."""
        self.reduce_started = True
        with collective_label(f"unit {self.label}"):
            self._start_reduce()

    def _start_reduce(self) -> None:
        if not self.trainable:
            return  # a frozen unit has nothing to reduce
        if self.direct_grads:
            self.reduce_work = CompletedWork()  # nothing to reduce: finish_reduce hands the gradients over
            return
        self._ready_grad_buffer()
        self._drop_grad_views()
        used = self.used_here = self._zero_unwritten()
        if self.shard_comm.size == 1 and self.replicate_comm is None and self.compressor is None:
            # The average over one rank is the buffer itself (data, then the flags' band: one segment): no copy.
            self.reduced_shard, self.reduce_work, self.replicated = self.grad_buffer, CompletedWork(), False
            return
        self.reduced_shard = torch.empty(self.grad_layout.segment, dtype=self.reduce_dtype, device=self.device)
        if not self.grad_layout.band:
            self._start_flags(used)
        if self.shard_comm.size == 1 and self.replicate_comm is not None:
            # No sharding (DDP-like): skip the trivial reduce-scatter, all-reduce over the replicas right away.
            self.reduced_shard.copy_(self.grad_buffer)
            if self.compressor is not None:
                self.reduce_work = self.compressor.reduce(self.index, self.reduced_shard, self.replicate_comm,
                                                          [info.shape for info in self.infos])
            else:
                self.reduce_work = self.replicate_comm.all_reduce(self.reduced_shard, ReduceOp.AVG, async_op=True)
            self.replicated = True
            return
        self.replicated = False
        compressing = self.compressor is not None and self.replicate_comm is None
        self.compressed_whole = compressing and not self.compressor.reduces_scatter
        if compressing and self.compressor.reduces_scatter:  # a 16-bit cast: still a reduce-scatter
            self.reduce_work = self.compressor.reduce_scatter(self.index, self.grad_buffer, self.reduced_shard,
                                                              self.shard_comm)
            return
        if self.compressed_whole:
            assert self.compressor is not None
            self.reduce_work = self.compressor.reduce(self.index, self.grad_buffer, self.shard_comm,
                                                      [info.shape for info in self.infos])
            return
        # The flat buffer is scratch from here on (zeroed or freed before it accumulates again): a backend may
        # reduce in it in place (gloo then skips cloning it).
        self.reduce_work = self.shard_comm.reduce_scatter(self.reduced_shard, self.grad_buffer, ReduceOp.AVG,
                                                          async_op=True, scratch_input=True)

    def finish_reduce(self) -> None:
        """Wait for the reduce-scatter, average over replicas, and hand the shard to the shard parameters' .grad."""
        with collective_label(f"unit {self.label}"):
            self._finish_reduce()

    def _finish_reduce(self) -> None:
        if not self.trainable or self.reduce_work is None:
            return  # frozen, or already finished (the engine finishes the oldest reductions early)
        if self.direct_grads:
            self.reduce_work = None
            self._hand_over_grads()
            return
        assert self.reduced_shard is not None
        self.reduce_work.wait()
        self.reduce_work = None
        if self.compressed_whole:  # the compressed all-reduce left the average in the whole buffer: take our shard
            self.reduced_shard.copy_(self.grad_buffer[self.shard_range[0] : self.shard_range[1]])
        if self.replicate_comm is not None and not self.replicated:
            if self.compressor is not None:
                pieces = [torch.Size([info.shard_hi - info.shard_lo]) for info in self.infos]  # per-tensor scales
                self.compressor.reduce(self.index, self.reduced_shard, self.replicate_comm, pieces).wait()
            else:
                self.replicate_comm.all_reduce(self.reduced_shard, ReduceOp.AVG)  # the flags' band too
        used = self._finish_flags()
        start = self.shard_range[0]
        reduced = self.reduced_shard[: self.shard_size]
        if self.keep_grad_buffer and self.grad_buffer is not None:
            # Gradients are not sharded (stage 1, no_shard): the averaged shard lives in the buffer's own slice and
            # the shard parameters' .grad view it, so gradients cost exactly the one full buffer.
            own = self.grad_layout.own(self.grad_buffer, self.shard_comm.rank)
            if self.reduced_shard is not self.grad_buffer:  # a group of one reduced in the buffer itself
                own.copy_(reduced)
            reduced = own
            self.grad_buffer_dirty = True
        # Offloaded: always a copy, so the gradient lives on the host as on a GPU, even where host is the device.
        shard = reduced.to(self.master_device, self.master_dtype, copy=self.offload != "none")
        whole = self._whole_views(shard) if self.whole_pieces else {}
        for info, was_used in zip(self.trainable, used):
            if not was_used:
                continue  # no rank used it: .grad stays as it was (None after zero_grad), as in one process
            piece = whole.get(info.name)
            if piece is None:
                piece = shard[info.offset + info.shard_lo - start : info.offset + info.shard_hi - start]
                piece = piece if info.shard_hi > info.shard_lo else shard[:0]
                piece = piece.view(info.shape) if self.whole_pieces else piece
            self._give_grad(info, grad_like(piece, info.shard_param) if self.whole_pieces
                            else as_sharded(piece, spec_of(info.shard_param)))  # answering for the whole tensor
        self.reduced_shard = None
        if not self.keep_grad_buffer:
            self._drop_grad_buffer()

    def _hand_over_grads(self) -> None:
        """`direct_grads`: each unsharded parameter's gradient (autograd's tensor, its backwards summed) becomes its
        shard parameter's .grad, the same shape and memory layout; added to one already there (a second backward
        before the step, as torch adds). A parameter without one keeps its .grad, None after zero_grad."""
        for info in self.trainable:
            grad, info.unsharded.grad = info.unsharded.grad, None
            if grad is not None:
                self._give_grad(info, grad_like(grad, info.shard_param))

    def _give_grad(self, info: ParamInfo, grad: torch.Tensor) -> None:
        """The averaged `grad` (shaped like the shard parameter: whole, or a piece answering for it) into its
        `.grad`, through the user's gradient hooks on the shard parameter when it has any
        (param_hooks.run_gradient_hooks)."""
        if has_gradient_hooks(info.shard_param):
            run_gradient_hooks(info.shard_param, grad, functools.partial(self._add_grad, info))
        else:
            self._add_grad(info, grad)

    @staticmethod
    def _add_grad(info: ParamInfo, grad: torch.Tensor) -> None:
        """`grad` as the shard parameter's `.grad`, or added to one already there (a second reduced backward before
        the step, as torch adds); a hook's plain replacement is described as the piece again."""
        if info.shard_param.grad is None:
            info.shard_param.grad = grad if is_sharded(grad) else grad_like(grad, info.shard_param)
        else:
            held = local(info.shard_param.grad)
            held.add_(local(grad).view(held.shape))

    def _start_flags(self, used: list[bool]) -> None:
        """Under compression: all-reduce the used flags (exact, SUM) over the group the gradients reduce over first."""
        self.flags = torch.tensor([1.0 if u else 0.0 for u in used], dtype=torch.float32).to(self.device,
                                                                                             non_blocking=True)
        comm = self.shard_comm if self.shard_comm.size > 1 else self.replicate_comm
        self.flag_work = comm.all_reduce(self.flags, ReduceOp.SUM, async_op=True) if comm is not None else None

    def _finish_flags(self) -> list[bool]:
        """Which trainable parameters some rank used this cycle: from the reduced band, or the flags' all-reduce."""
        if self.grad_layout.band:
            return self.grad_layout.read_flags(self.reduced_shard, self.used_here)
        assert self.flags is not None
        if self.flag_work is not None:
            self.flag_work.wait()
            self.flag_work = None
        if self.replicate_comm is not None and self.shard_comm.size > 1:
            self.replicate_comm.all_reduce(self.flags, ReduceOp.SUM)
        # Used here means used somewhere: the host reads the flags (waiting for the GPU) only when it must.
        used = list(self.used_here) if all(self.used_here) else (self.flags > 0).tolist()
        self.flags = None
        return used

    def _drop_grad_buffer(self) -> None:
        self._drop_grad_views()
        if self.grad_buffer is not None:
            self.grad_memory.freed(self.grad_buffer.numel() * self.grad_buffer.element_size())
            self.grad_buffer = None

    def abandon(self) -> None:
        """Return to the state between steps after a forward or backward that raised: wait for issued collectives
        (every rank issued them, in order), forget the partial reduction and gradients, reshard."""
        for work in (self.pending_gather, self.reduce_work, self.flag_work):
            if work is not None:
                work.wait()
        self.pending_gather = self.reduce_work = self.reduced_shard = self.flag_work = self.flags = None
        self.entered = False
        self.grads_seen = set()
        self.grad_pending = 0
        self.grad_views = {}
        for info in self.infos:
            info.unsharded.grad = None
        if self.grad_buffer is not None:
            if self.keep_grad_buffer:
                self._ready_grad_buffer()
                self.grads_written = set()  # what the abandoned pass wrote counts as never written
                self.grad_buffer_zeroed = False  # and autograd may have added into the views: zero it again
            else:
                self._drop_grad_buffer()
        self.swap_to_sharded()
        self.free_full()

    def _ready_grad_buffer(self) -> None:
        """Allocate the flat gradient buffer, or start a new accumulation cycle in a kept one.

        The buffer is never zeroed as a whole: a parameter's first gradient of the cycle is copied into its slice
        (`grads_written` remembers which), and `_zero_unwritten` clears only what no gradient wrote (padding,
        frozen parameters, unused ones) just before the reduction: one pass over the memory instead of a memset
        and an add (PyTorch DDP's buckets copy the first gradient the same way)."""
        if self.grad_buffer is None:
            self.grad_buffer = torch.empty(self.grad_layout.numel, dtype=self.reduce_dtype, device=self.device)
            self.grad_memory.allocated(self.grad_buffer.numel() * self.grad_buffer.element_size())
            self.grads_written = set()
            self.grad_buffer_dirty = False
            self.grad_buffer_zeroed = False
        elif self.grad_buffer_dirty:
            self.copy_out_kept_grads()  # gradients the user kept (no zero_grad) must survive the new cycle
            self.grads_written = set()
            self.grad_buffer_dirty = False
            self.grad_buffer_zeroed = False

    def copy_out_kept_grads(self) -> None:
        """A shard parameter's `.grad` that views the kept gradient buffer (stage 1, no_shard) becomes a copy of its
        own, before the buffer is reused or dropped."""
        storage = self.grad_buffer.untyped_storage().data_ptr()
        for info in self.trainable:
            g = info.shard_param.grad
            if g is not None and g.untyped_storage().data_ptr() == storage:
                info.shard_param.grad = g.clone()

    def _zero_unwritten(self) -> list[bool]:
        """Zero every data element of the flat buffer that no gradient of this cycle was copied into, write the
        used flags, and return them (per trainable parameter: whether this rank wrote its gradient this cycle)."""
        assert self.grad_buffer is not None
        used = [info.name in self.grads_written for info in self.trainable]
        if self.grad_buffer_zeroed:  # filled with zeros at the cycle's start: nothing unwritten to clear
            self.grad_layout.write_flags(self.grad_buffer, used)
            self.grads_written = {info.name for info in self.infos}
            self.grad_buffer_zeroed = False  # the reduction may use the buffer as scratch
            return used
        start = 0
        gaps = []
        for info in self.infos:
            if info.name in self.grads_written:
                gaps.append((start, info.offset))
                start = info.offset + info.numel
        gaps.append((start, self.padded))
        for lo, hi in gaps:
            for at, _, n in self.grad_layout.runs(lo, hi - lo):
                self.grad_buffer[at : at + n].zero_()
        self.grad_layout.write_flags(self.grad_buffer, used)
        self.grads_written = {info.name for info in self.infos}  # all of it holds this cycle's values now
        return used
