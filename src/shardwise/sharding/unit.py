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
  In fp32 stage 1/2 (parameters kept whole) the master shard is a view of the full buffer: no copy at all; so it is
  in every stage for a shard group of one in the master's dtype, where the full buffer is never freed or gathered.
* with `cpu_offload="optimizer"` in stage 3, the **compute shard** (param_dtype, s elements, on the device): the
  master's values in the compute dtype, refreshed once after each optimizer step, which the all-gathers read
  (ZeRO-Offload's device-resident fp16 partition; see `offload`).
* the **gradient buffer** (reduce_dtype, `padded` elements plus, in each rank's chunk, one "used" flag per
  trainable parameter: `grad_layout`): unsharded gradients are added into it as they are produced; one
  reduce-scatter (AVG) leaves this rank's averaged shard and the flags, then an all-reduce over the replicate group
  for hybrid sharding, and the result becomes the shard parameters' `.grad`, except for parameters no rank used,
  whose `.grad` stays as it was (None), as in one process.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..comm.base import Communicator, Work
from ..comm.labels import collective_label
from ..compression.base import Compressor
from ..param_hooks import carry_grad_hooks
from ..sharded_tensor import ShardSpec, as_sharded, local, on_data_read, spec_of
from .grad_layout import GradLayout
from .policy import UnitPlan
from .param_info import ParamInfo
from .unit_grads import UnitGradients

__all__ = ["Unit", "ParamInfo", "GatheredMemory", "describe_units"]


def describe_units(units: list[Unit], shown: int = 6) -> str:
    """'blocks.0 (0.79M params, 3 tensors), ...': the units the log line names (the first `shown`, then a count)."""
    parts = [f"{u.label} ({u.numel / 1e6:.3g}M params, {len(u.infos)} tensors)" for u in units[:shown]]
    if len(units) > shown:
        parts.append(f"... {len(units) - shown} more")
    return ", ".join(parts)


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


class Unit(UnitGradients):
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
        self.label = plan.name or "<root>"  # how logs and profiler ranges name it (the root unit's name is "")
        self.memory = memory
        self.grad_memory = grad_memory if grad_memory is not None else GatheredMemory()
        self.index = index
        self.modules = plan.modules
        self.is_root = plan.is_root
        self.shard_comm = shard_comm
        self.replicate_comm = replicate_comm if replicate_comm is not None and replicate_comm.size > 1 else None
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
        if shard_comm.size == 1 and self.param_dtype == self.master_dtype and offload == "none":
            # A shard group of one in the master's dtype: the full buffer would hold the master's very values, so
            # it is the master (below) and is never freed; stage 3 then gathers nothing and frees nothing, as
            # nothing is duplicated (ZeRO-3 on one GPU costs what plain PyTorch does).
            keep_full = True
        self.keep_full = keep_full
        self.reduce_dtype = reduce_dtype or (torch.float32 if param_dtype is not None else self.param_dtype)
        self.offload = offload  # an offload level (see .offload): "none", "optimizer" or "full"
        self.master_device = torch.device("cpu") if offload != "none" else self.device
        if any(p.dtype != self.master_dtype for p in plan.params):
            raise ValueError(f"unit {self.name!r} mixes parameter dtypes {sorted({str(p.dtype) for p in plan.params})}: "
                             f"a unit's parameters are one flat buffer of one dtype; give the modules holding the "
                             f"other dtype's parameters units of their own (wrap=their class), or use one dtype")

        n = shard_comm.size
        # A tensor-parallel slice is flattened as the slice it stores (sharded_tensor.local), not the dense
        # tensor it answers for.
        pieces = {p: local(p) for p in plan.params}
        self.numel = sum(pieces[p].numel() for p in plan.params)
        self.padded = math.ceil(self.numel / n) * n
        self.shard_size = self.padded // n
        start = shard_comm.rank * self.shard_size
        self.shard_range = (start, start + self.shard_size)

        # The full buffer starts filled with the original values, so the model is usable straight away.
        self.full = torch.zeros(self.padded, dtype=self.param_dtype, device=self.device)
        offset = 0
        with torch.no_grad():
            for p in plan.params:
                self.full[offset : offset + pieces[p].numel()].copy_(pieces[p].detach().reshape(-1))
                offset += pieces[p].numel()
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
                    lo, hi = max(start, offset), min(start + self.shard_size, offset + pieces[p].numel())
                    if lo < hi:
                        self.master[lo - start : hi - start].copy_(
                            pieces[p].detach().reshape(-1)[lo - offset : hi - offset])
                    offset += pieces[p].numel()

        self.infos: list[ParamInfo] = []
        self.whole_pieces = n == 1
        offset = 0
        for p in plan.params:
            shape, numel = pieces[p].shape, pieces[p].numel()
            lo, hi = self.piece_of(offset, numel, shard_comm.rank)
            piece = self.master[offset + lo - start : offset + hi - start] if hi > lo else self.master[:0]
            if self.whole_pieces and spec_of(p) is not None:  # a tensor-parallel slice, whole: still a slice
                shard_param = as_sharded(piece.view(shape), spec_of(p), parameter=True, requires_grad=p.requires_grad)
            elif self.whole_pieces:  # no_shard, or a group of one: the piece is the whole tensor, in its own shape
                shard_param = nn.Parameter(piece.view(shape), requires_grad=p.requires_grad)
            else:  # this rank's piece, answering for the whole parameter (shape, dim, numel: sharded_tensor.py);
                # the strategy re-describes it with the original name and global shape once placements are known
                shard_param = as_sharded(piece, ShardSpec(p.shape, names[p], flat=True), parameter=True,
                                         requires_grad=p.requires_grad)
            on_data_read(shard_param, self.mark_stale)  # a write through .data bumps no version counter
            unsharded = nn.Parameter(self.full[offset : offset + numel].view(shape), requires_grad=p.requires_grad)
            carry_grad_hooks(p, unsharded, names[p], "ZeRO/FSDP")  # the user's (and sequence parallel's) hooks
            self.infos.append(
                ParamInfo(names[p], shape, numel, offset, p.requires_grad, plan.locations[p], lo, hi,
                          shard_param, unsharded)
            )
            offset += numel
        self.trainable = [i for i in self.infos if i.requires_grad]
        # Nothing to reduce over (a shard group of one, no replicas, no compression) and the gradient already in the
        # master's dtype: autograd's own gradient tensors become the shard parameters' .grad (unit_grads), as in
        # plain PyTorch: no flat buffer, no copy, no kernel per parameter.
        self.direct_grads = (n == 1 and self.replicate_comm is None and compressor is None and self.master_is_view
                             and self.reduce_dtype == self.master_dtype)
        # One "used" flag per trainable parameter rides in each chunk of the reduction (grad_layout); under a lossy
        # gradient compression they travel in a small exact all-reduce of their own instead.
        self.flags_in_band = compressor is None or (compressor.keeps_flags and self.replicate_comm is None)
        self.grad_layout = GradLayout(n, self.shard_size, len(self.trainable) if self.flags_in_band else 0)
        self.flag_work: Work | None = None
        self.flags: torch.Tensor | None = None
        self.used_here: list[bool] = []  # this rank's used flags of the reduction in flight (unit_grads)

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
        self.grad_buffer_zeroed = False  # filled with zeros at this cycle's start (unit_grads.prepare_grad_views)
        self.grad_views: dict[str, tuple[ParamInfo, torch.Tensor]] = {}  # unsharded .grad viewing the buffer
        self.grad_view_groups: list[tuple[int, list[ParamInfo]]] | None = None  # unit_grads._view_groups
        self.grad_pending = 0
        self.grads_seen: set[str] = set()
        self.reduce_started = False  # this backward's reduce-scatter was launched (unit_grads.start_reduce)
        self.reduce_work: Work | None = None
        self.reduced_shard: torch.Tensor | None = None
        self.replicated = False
        self.entered = False  # inside the unit's forward (between its first pre-hook and its post-hook)
        self._install("shard_param", replacing_originals=True)
        self.unsharded_in_modules = False
        if not keep_full:
            memory.allocated(self.full_bytes)  # so that freeing balances
            self.free_full()

    def requires_grad_changed(self) -> bool:
        """Whether the user froze or unfroze a parameter of this unit since the last forward: `requires_grad` of
        the shard parameters (what `model.parameters()` yields between steps) against what the unit follows."""
        with torch._C.DisableTorchFunctionSubclass():  # a piece's attribute read: 14 instead of 200 us per 148
            return any(info.shard_param.requires_grad is not info.requires_grad for info in self.infos)

    def follow_requires_grad(self) -> list[ParamInfo]:
        """Take the shard parameters' `requires_grad` as the unit's (a fine-tuning script that freezes or unfreezes
        layers between steps): the unsharded parameters that autograd sees follow, the trainable set and the flag
        band of the gradient layout are rebuilt, and the gradient buffer is dropped (its layout changed; a `.grad`
        the user kept that views it is copied out first). A parameter frozen now gets no gradient, so it keeps its
        `.grad`, as in one process. Between steps only (the engine refuses a change within an accumulation).
        Returns the parameters that became trainable (they need a gradient hook)."""
        changed = [info for info in self.infos if info.shard_param.requires_grad is not info.requires_grad]
        for info in changed:
            info.requires_grad = info.shard_param.requires_grad
            info.unsharded.requires_grad_(info.requires_grad)
        if self.grad_buffer is not None:
            self.copy_out_kept_grads()  # over the trainable set the buffer was laid out for
            self._drop_grad_buffer()
        self.trainable = [i for i in self.infos if i.requires_grad]
        self.grad_layout = GradLayout(self.shard_comm.size, self.shard_size,
                                      len(self.trainable) if self.flags_in_band else 0)
        self.grad_view_groups = None
        return [info for info in changed if info.requires_grad]

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

    def mark_stale(self) -> None:
        """The master may have changed in a way its version counter does not show (a write through a shard
        parameter's `.data`): the next forward gathers (and refreshes the device shard) again."""
        self.gathered_version = self.compute_version = None

    def needs_gather(self) -> bool:
        if self.numel == 0 or (self.master_is_view and self.shard_comm.size == 1):
            return False  # nothing to gather, or the full buffer is the master itself
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
        with collective_label(f"unit {self.label}"):  # ranks gathering different units raise (comm/labels.py)
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

    def _install(self, which: str, replacing_originals: bool = False) -> None:
        for info in self.infos:
            tensor = getattr(info, which)
            for module, attr in info.locations:
                current = module._parameters.get(attr)
                if not replacing_originals and current is not info.shard_param and current is not info.unsharded:
                    continue  # the caller's own tensor, swapped in for this call (torch.func.functional_call)
                module._parameters[attr] = tensor  # bypasses __setattr__: no re-registration, same key order

    def swap_to_unsharded(self) -> None:
        if not self.unsharded_in_modules:
            self._install("unsharded")
            self.unsharded_in_modules = True

    def swap_to_sharded(self) -> None:
        if self.unsharded_in_modules:
            self._install("shard_param")
            self.unsharded_in_modules = False
