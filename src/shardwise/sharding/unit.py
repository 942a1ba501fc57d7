"""One sharding unit: its parameters as one flat, padded buffer split evenly across the shard group.

Layout. The unit's parameters are concatenated (flattened) in registration order into `numel` elements, padded to
`padded = ceil(numel / N) * N`, and rank r owns elements [r*s, (r+1)*s) with s = padded / N (ZeRO, Rajbhandari et
al. 2020). Every rank's shard has the same size, so one all-gather and one reduce-scatter move the whole unit.

Three kinds of tensors per unit:
* the **master shard** (fp32, s elements; on the host with CPU offload): what the optimizer updates. Each original
  parameter is represented by a `shard parameter`: an nn.Parameter viewing the slice of the master shard that
  intersects it (1-D, possibly empty). These are what `model.named_parameters()` yields between steps.
* the **full buffer** (param_dtype, `padded` elements): the gathered compute copy. `unsharded parameters` are
  nn.Parameters viewing it with the original shapes; they are swapped into the modules for forward and backward.
  To free it (stage 3 after forward, and after backward) its *storage* is resized to zero while the tensors that
  view it survive; gathering again refills the same storage, so tensors saved by autograd in forward are valid
  again when backward needs them (the technique of PyTorch FSDP). Writes go through `.data`, whose version counter
  is separate, so refilling does not trip autograd's in-place check.
  In fp32 stage 1/2 (parameters kept whole) the master shard is a view of the full buffer: no copy at all.
* with `cpu_offload="optimizer"` in stage 3, the **compute shard** (param_dtype, s elements, on the device): the
  master's values in the compute dtype, refreshed once after each optimizer step, which the all-gathers read
  (ZeRO-Offload's device-resident fp16 partition; see `offload`).
* the **gradient buffer** (reduce_dtype, `padded` elements): unsharded gradients are added into it as they are
  produced; one reduce-scatter (AVG) leaves this rank's averaged shard, then an all-reduce over the replicate group
  for hybrid sharding, and the result becomes the shard parameters' `.grad`.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from ..comm.base import Communicator, ReduceOp, Work
from ..compression.base import Compressor
from .policy import UnitPlan

__all__ = ["Unit", "ParamInfo", "GatheredMemory"]


class GatheredMemory:
    """Bytes of temporarily gathered (freeable) full buffers alive now, and the peak: memory_stats' gathered_peak."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def allocated(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def freed(self, nbytes: int) -> None:
        self.live -= nbytes


@dataclasses.dataclass
class ParamInfo:
    """Where one original parameter lives in its unit's flat layout, and this rank's piece of it."""

    name: str
    shape: torch.Size
    numel: int
    offset: int  # in the flat (unpadded) layout
    requires_grad: bool
    locations: list[tuple[nn.Module, str]]
    shard_lo: int  # this rank's piece: flat elements [shard_lo, shard_hi) of the parameter's own flattening
    shard_hi: int
    shard_param: nn.Parameter
    unsharded: nn.Parameter


class Unit:
    """See the module docstring. `keep_full`: the full buffer is never freed (ZeRO-1/2, no_shard)."""

    def __init__(
        self,
        plan: UnitPlan,
        index: int,
        names: dict[nn.Parameter, str],
        shard_comm: Communicator,
        replicate_comm: Communicator | None,
        *,
        keep_full: bool,
        keep_grad_buffer: bool,
        param_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
        offload: str,
        memory: GatheredMemory,
        grad_memory: GatheredMemory | None = None,
        compressor: Compressor | None = None,
    ) -> None:
        self.name = plan.name
        self.memory = memory
        self.grad_memory = grad_memory if grad_memory is not None else GatheredMemory()
        self.index = index
        self.modules = plan.modules
        self.is_root = plan.is_root
        self.shard_comm = shard_comm
        self.replicate_comm = replicate_comm if replicate_comm is not None and replicate_comm.size > 1 else None
        self.keep_full = keep_full
        self.keep_grad_buffer = keep_grad_buffer
        # Gradient compression (sw.compression): of the replicate all-reduce, or (ZeRO-1/2) of the whole unit's
        # gradient by a compressed all-reduce instead of the reduce-scatter, after which this rank keeps its shard.
        self.compressor = compressor
        self.compressed_whole = False
        # A root unit may own nothing (every parameter is in some unit): it then only carries the root hooks.
        first = plan.params[0] if plan.params else torch.empty(0)
        self.device = first.device
        self.master_dtype = first.dtype
        self.param_dtype = param_dtype or first.dtype
        self.reduce_dtype = reduce_dtype or (torch.float32 if param_dtype is not None else self.param_dtype)
        self.offload = offload  # an offload level (see .offload): "none", "optimizer" or "full"
        self.master_device = torch.device("cpu") if offload != "none" else self.device
        if any(p.dtype != self.master_dtype for p in plan.params):
            raise ValueError(f"unit {self.name!r} mixes parameter dtypes {sorted({str(p.dtype) for p in plan.params})}")

        n = shard_comm.size
        self.numel = sum(p.numel() for p in plan.params)
        self.padded = math.ceil(self.numel / n) * n
        self.shard_size = self.padded // n
        start = shard_comm.rank * self.shard_size
        self.shard_range = (start, start + self.shard_size)

        # The full buffer starts filled with the original values, so the model is usable straight away.
        self.full = torch.zeros(self.padded, dtype=self.param_dtype, device=self.device)
        offset = 0
        with torch.no_grad():
            for p in plan.params:
                self.full[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
                offset += p.numel()
        self.master_is_view = keep_full and self.param_dtype == self.master_dtype and offload == "none"
        if self.master_is_view:
            self.master = self.full.data[start : start + self.shard_size]
        else:
            # From the user's own values, not from the (possibly bf16-rounded) full buffer: master weights must be
            # exactly what the user wrapped.
            # Offloaded from a GPU: page-locked, so the host-to-device copies of each gather can be asynchronous.
            pinned = self.master_device != self.device and self.device.type == "cuda"
            self.master = torch.zeros(self.shard_size, dtype=self.master_dtype, device=self.master_device,
                                      pin_memory=pinned)
            offset = 0
            with torch.no_grad():
                for p in plan.params:
                    lo, hi = max(start, offset), min(start + self.shard_size, offset + p.numel())
                    if lo < hi:
                        self.master[lo - start : hi - start].copy_(p.detach().reshape(-1)[lo - offset : hi - offset])
                    offset += p.numel()

        self.infos: list[ParamInfo] = []
        offset = 0
        for p in plan.params:
            lo, hi = self.piece_of(offset, p.numel(), shard_comm.rank)
            piece = self.master[offset + lo - start : offset + hi - start] if hi > lo else self.master[:0]
            shard_param = nn.Parameter(piece, requires_grad=p.requires_grad)
            unsharded = nn.Parameter(self.full[offset : offset + p.numel()].view(p.shape), requires_grad=p.requires_grad)
            self.infos.append(
                ParamInfo(names[p], p.shape, p.numel(), offset, p.requires_grad, plan.locations[p], lo, hi,
                          shard_param, unsharded)
            )
            offset += p.numel()
        self.trainable = [i for i in self.infos if i.requires_grad]

        self.gathered_version: int | None = self._master_version()  # the full buffer matches the master now
        # ZeRO-Offload's device-resident shard in the compute dtype (stage 3 with "optimizer" offload only).
        self.compute_shard: torch.Tensor | None = None
        self.compute_version: int | None = None
        if offload == "optimizer" and not keep_full:
            self.compute_shard = torch.empty(self.shard_size, dtype=self.param_dtype, device=self.device)
        self.pending_gather: Work | None = None
        self.grad_buffer: torch.Tensor | None = None
        self.grad_buffer_dirty = False  # holds last step's averaged shard, viewed by .grad: a new cycle before reuse
        self.grads_written: set[str] = set()  # parameters whose gradient this cycle's buffer holds
        self.grad_pending = 0
        self.grads_seen: set[str] = set()
        self.reduce_work: Work | None = None
        self.reduced_shard: torch.Tensor | None = None
        self.replicated = False
        self.entered = False  # inside the unit's forward (between its first pre-hook and its post-hook)
        self._install("shard_param")
        self.unsharded_in_modules = False
        if not keep_full:
            memory.allocated(self.full_bytes)  # so that freeing balances
            self.free_full()

    def piece_of(self, offset: int, numel: int, rank: int) -> tuple[int, int]:
        """The elements [lo, hi) of a parameter at `offset` (numel elements) that shard-group rank `rank` holds,
        in the parameter's own flattening; (0, 0) when none."""
        s = self.shard_size
        lo, hi = max(rank * s, offset) - offset, min((rank + 1) * s, offset + numel) - offset
        return (lo, hi) if hi > lo else (0, 0)

    # ---- parameters: gather, free, swap -----------------------------------------------------------------------
    def _master_version(self) -> int:
        # In-place optimizer updates of the shard parameters (views of the master shard) bump the master's version
        # counter, which views share with their base: an O(1) staleness test.
        return self.master._version

    @property
    def full_allocated(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    @property
    def full_bytes(self) -> int:
        return self.padded * self.full.element_size()

    def needs_gather(self) -> bool:
        if self.numel == 0:
            return False
        return not self.full_allocated or self.gathered_version != self._master_version()

    def start_gather(self) -> None:
        """Issue the all-gather of the master shards into the full buffer (asynchronously) if it is stale."""
        if self.pending_gather is not None or not self.needs_gather():
            return
        if not self.full_allocated:
            self.full.untyped_storage().resize_(self.full_bytes)
            self.memory.allocated(self.full_bytes)
        source = self._gather_source()
        self.gathered_version = self._master_version()
        self.pending_gather = self.shard_comm.all_gather(self.full.data, source, async_op=True)

    def _gather_source(self) -> torch.Tensor:
        """This rank's shard in the compute dtype on the device: what the all-gather sends."""
        if self.compute_shard is not None:
            if self.compute_version != self._master_version():  # once per optimizer step, not once per gather
                self.compute_shard.copy_(self.master.detach(), non_blocking=True)
                self.compute_version = self._master_version()
            return self.compute_shard
        # From pinned host memory the copy is queued on the stream and does not block the host; the master only
        # changes in the optimizer step, which runs after the blocking device-to-host gradient copies.
        source = self.master.detach().to(self.device, self.param_dtype, non_blocking=True)
        if self.master_is_view:
            source = source.clone()  # never gather from a slice of the very buffer being written
        return source

    def wait_gather(self) -> None:
        self.start_gather()
        if self.pending_gather is not None:
            self.pending_gather.wait()
            self.pending_gather = None

    def free_full(self) -> None:
        if self.pending_gather is not None:
            self.pending_gather.wait()
            self.pending_gather = None
        if not self.keep_full and self.full_allocated:
            self.full.untyped_storage().resize_(0)
            self.memory.freed(self.full_bytes)

    def _install(self, which: str) -> None:
        for info in self.infos:
            tensor = getattr(info, which)
            for module, attr in info.locations:
                module._parameters[attr] = tensor  # bypasses __setattr__: no re-registration, same key order

    def swap_to_unsharded(self) -> None:
        if not self.unsharded_in_modules:
            self._install("unsharded")
            self.unsharded_in_modules = True

    def swap_to_sharded(self) -> None:
        if self.unsharded_in_modules:
            self._install("shard_param")
            self.unsharded_in_modules = False

    # ---- gradients --------------------------------------------------------------------------------------------
    def begin_backward(self) -> None:
        self.grad_pending = len(self.trainable)
        self.grads_seen: set[str] = set()

    def accumulate_grad(self, info: ParamInfo) -> None:
        """Add an unsharded gradient into the flat gradient buffer (allocated, zeroed, on first use)."""
        grad = info.unsharded.grad
        if grad is not None:
            self._ready_grad_buffer()
            piece = self.grad_buffer[info.offset : info.offset + info.numel]
            if info.name in self.grads_written:
                piece.add_(grad.reshape(-1))  # a second backward under no_sync(): accumulate
            else:
                piece.copy_(grad.reshape(-1))  # first of the cycle: the buffer was never zeroed for it
                self.grads_written.add(info.name)
            info.unsharded.grad = None  # the flat buffer holds it now; free the unsharded gradient
        if info.name not in self.grads_seen:
            self.grads_seen.add(info.name)
            self.grad_pending -= 1

    def flush_unused(self) -> None:
        """End of backward: parameters whose hook never fired contribute zeros (or a gradient left on them)."""
        for info in self.trainable:
            if info.name not in self.grads_seen:
                self.accumulate_grad(info)

    def start_reduce(self) -> None:
        """Reduce-scatter (AVG) the flat gradient buffer into this rank's shard, asynchronously."""
        if not self.trainable:
            return  # a frozen unit has nothing to reduce
        self._ready_grad_buffer()
        self._zero_unwritten()
        self.reduced_shard = torch.empty(self.shard_size, dtype=self.reduce_dtype, device=self.device)
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
        if not self.trainable or self.reduce_work is None:
            return  # frozen, or already finished (the engine finishes the oldest reductions early)
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
                self.replicate_comm.all_reduce(self.reduced_shard, ReduceOp.AVG)
        start = self.shard_range[0]
        reduced = self.reduced_shard
        if self.keep_grad_buffer and self.grad_buffer is not None:
            # Gradients are not sharded (stage 1, no_shard): the averaged shard lives in the buffer's own slice and
            # the shard parameters' .grad view it, so gradients cost exactly the one full buffer.
            own = self.grad_buffer[start : start + self.shard_size]
            own.copy_(reduced)
            reduced = own
            self.grad_buffer_dirty = True
        # Offloaded: always a copy, so the gradient lives on the host as on a GPU, even where host is the device.
        shard = reduced.to(self.master_device, self.master_dtype, copy=self.offload != "none")
        for info in self.trainable:
            piece = shard[info.offset + info.shard_lo - start : info.offset + info.shard_hi - start]
            if info.shard_param.grad is None:
                info.shard_param.grad = piece if info.shard_hi > info.shard_lo else shard[:0]
            else:
                info.shard_param.grad.add_(piece)
        self.reduced_shard = None
        if not self.keep_grad_buffer:
            self._drop_grad_buffer()

    def _drop_grad_buffer(self) -> None:
        if self.grad_buffer is not None:
            self.grad_memory.freed(self.grad_buffer.numel() * self.grad_buffer.element_size())
            self.grad_buffer = None

    def abandon(self) -> None:
        """Return to the state between steps after a forward or backward that raised: wait for issued collectives
        (every rank issued them, in order), forget the partial reduction and gradients, reshard."""
        for work in (self.pending_gather, self.reduce_work):
            if work is not None:
                work.wait()
        self.pending_gather = self.reduce_work = self.reduced_shard = None
        self.entered = False
        self.grads_seen = set()
        self.grad_pending = 0
        for info in self.infos:
            info.unsharded.grad = None
        if self.grad_buffer is not None:
            if self.keep_grad_buffer:
                self._ready_grad_buffer()
                self.grads_written = set()  # what the abandoned pass wrote counts as never written
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
            self.grad_buffer = torch.empty(self.padded, dtype=self.reduce_dtype, device=self.device)
            self.grad_memory.allocated(self.grad_buffer.numel() * self.grad_buffer.element_size())
            self.grads_written = set()
            self.grad_buffer_dirty = False
        elif self.grad_buffer_dirty:
            storage = self.grad_buffer.untyped_storage().data_ptr()
            for info in self.trainable:  # gradients the user kept (no zero_grad) must survive the new cycle
                g = info.shard_param.grad
                if g is not None and g.untyped_storage().data_ptr() == storage:
                    info.shard_param.grad = g.clone()
            self.grads_written = set()
            self.grad_buffer_dirty = False

    def _zero_unwritten(self) -> None:
        """Zero every element of the flat buffer that no gradient of this cycle was copied into."""
        assert self.grad_buffer is not None
        start = 0
        for info in self.infos:
            if info.name in self.grads_written:
                if info.offset > start:
                    self.grad_buffer[start : info.offset].zero_()
                start = info.offset + info.numel
        if start < self.padded:
            self.grad_buffer[start:].zero_()
        self.grads_written = {info.name for info in self.infos}  # all of it holds this cycle's values now
