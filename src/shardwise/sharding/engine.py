"""The sharding engine: when each unit is gathered, freed and reduced, driven by module and autograd hooks.

One engine serves ZeRO stages 1/2/3 and the FSDP strategies; a `ShardingConfig` says which. Per training step:

forward
    root pre-forward: start of an iteration; the root unit (parameters no other unit claims) is gathered.
    unit pre-forward: wait for the unit's all-gather (issued earlier as a prefetch, or now), swap the unsharded
        parameters into the modules, and issue the NEXT unit's all-gather asynchronously (forward order is
        recorded on the first iteration), so communication overlaps this unit's compute. Floating inputs that
        require grad pass through an identity autograd function whose backward marks the unit's backward done.
    unit post-forward: hooks go on the outputs (their gradient marks the unit's backward start); with
        `reshard_after_forward` (stage 3 / full_shard / hybrid) the full buffer is freed and shards swapped back,
        one unit late: the unit that just ran is freed when the next unit starts, so the LAST unit of the forward
        stays gathered into backward, where it runs first (what torchtitan gets from reshard_after_forward=False on
        its last block and DeepSpeed stage 3 from its reuse distance): one all-gather fewer per step, and backward
        starts without waiting for a gather. Under `no_sync()` (pipeline microbatches, accumulation) units free at
        once, since other forwards may run before this one's backward.
backward
    unit pre-backward (gradient of an output ready): re-gather if freed, swap unsharded parameters in (activation
        checkpointing recomputes with them), and prefetch the previous unit's parameters.
    per parameter (post-accumulate-grad hook): add the gradient into the unit's flat gradient buffer; when the
        unit's last gradient is in, its reduce-scatter is launched asynchronously (in reverse forward order on every
        rank, which keeps the collective order identical across ranks). Under `no_sync()` nothing is launched: the
        flat buffers accumulate.
    unit post-backward (gradient of its inputs ready): free the full buffer unless parameters are kept whole.
    end of backward (autograd engine callback): launch what is left (units with parameters this rank did not use
        contribute zeros for them, and a 0 flag), wait for every reduction, hand each shard to the shard
        parameters' `.grad` (a parameter no rank used keeps None), free, swap shards back.
expert-parallel models
    a unit's expert slices, split over ranks of the data-parallel group, form a second unit over the same modules
    whose buffer is sharded over the expert-data-parallel group (expert_units.py): the unit and that companion are
    one *family*, gathered, swapped and freed together; each reduces its own gradients.
optimizer step
    updates the master shards in place; the next forward sees their version counters changed and re-gathers (for
    stage 1/2 that is the all-gather of updated parameters that ZeRO does after the step).
"""

from __future__ import annotations

import collections
import logging
from typing import Any

import torch
from torch import nn

from ..activation_checkpointing import checkpoint_module, every_kth
from ..agreement import agree_on_recovery
from ..comm.base import Communicator
from ..graph_gradients import KeptGraph, refuse_graph_accumulation
from ..placement import map_buffers
from ..profiler_ranges import profiler_range
from .expert_units import NO_EXPERTS, ExpertFamily, split_plan
from ..compiled import eager_while_traced
from .hook_tools import MarkBackwardDone, cast_floating, inside_backward, register_outermost, tensors_in
from .inner_calls import InnerCalls
from .policy import ShardingConfig, auto_group_mb, plan_units
from .outside_reads import OutsideReads
from .param_info import ParamInfo
from .replicated import ReplicatedParams
from .trainable import TrainableSet
from .unit import GatheredMemory, Unit, describe_units

__all__ = ["ShardingConfig", "ShardingEngine"]

log = logging.getLogger("shardwise.sharding")


class ShardingEngine:
    """Owns the units of one wrapped model and the hooks that drive them (see the module docstring)."""

    def __init__(self, model: nn.Module, comm: Communicator, shard_comm: Communicator,
                 replicate_comm: Communicator | None, config: ShardingConfig,
                 replicated_params: tuple[nn.Parameter, ...] = (), experts: ExpertFamily = NO_EXPERTS) -> None:
        self.model = model
        self.comm = comm  # every data-parallel rank (shard x replicate): what a recovering rank agrees over
        self.shard_comm = shard_comm
        self.replicate_comm = replicate_comm
        self.config = config
        mp = config.mixed_precision
        names = {p: n for n, p in model.named_parameters()}
        exclude = frozenset(replicated_params)
        group_mb = config.group_mb if config.group_mb is not None else auto_group_mb(model, exclude)
        plans = plan_units(model, config.wrap, group_mb, exclude)
        self.memory = GatheredMemory()
        self.grad_memory = GatheredMemory()  # flat (unsharded) gradient buffers alive, and their peak
        self._inflight: collections.deque[Unit] = collections.deque()
        self._finished_forward: Unit | None = None  # ran its forward, still gathered until the next unit starts
        # This rank's own compressor (its error-feedback memory is per rank, one entry per unit).
        self.compressor = config.compression.fresh() if config.compression is not None else None
        # Every unit, in plan order (a unit's expert companion right after it); `families` maps the unit that carries
        # the hooks (the dense one, or an expert unit alone) to its family.
        self.units: list[Unit] = []
        self.families: dict[Unit, tuple[Unit, ...]] = {}
        for plan in plans:
            family = []
            for part, shard, replicate in zip(split_plan(plan, experts.params), (shard_comm, experts.shard),
                                              (replicate_comm, experts.replicate)):
                if part is not None:
                    family.append(Unit(
                        part, len(self.units) + len(family), names, shard, replicate, keep_full=config.keep_full,
                        keep_grad_buffer=config.keep_grad_buffer, param_dtype=mp.param_dtype,
                        reduce_dtype=mp.reduce_dtype, offload=config.cpu_offload, memory=self.memory,
                        grad_memory=self.grad_memory, compressor=self.compressor))
            self.families[family[0]] = tuple(family)
            self.units += family
        self.root = list(self.families)[-1]
        log.info("%s: %d units over %d ranks; wrap=%r, group size %.3g MiB%s; units: %s", config.name,
                 len(self.units), shard_comm.size, config.wrap, group_mb,
                 " (chosen from the model: ~1/8 of its bytes, 2..25 MiB, so that several units overlap compute "
                 "and small layers merge)" if config.group_mb is None else "", describe_units(self.units))
        self.require_sync = True
        self.accumulating = False  # gradients of backward passes under no_sync() wait for their reduction
        self.in_backward = False
        self.forward_running = False  # between the root's pre- and post-forward: still set next time if it raised
        self.forward_order: list[Unit] = []
        self.forward_pos: dict[Unit, int] = {}
        self.order_recorded = False
        self.launch_order: list[Unit] = []
        self.next_launch = 0
        self.handles: list[Any] = []
        # Kept whole on every rank and all-reduced as DDP does (a weight tied across pipeline stages, whose two
        # copies must be summed before the data-parallel average): in no unit.
        self.replicated = ReplicatedParams(replicated_params, (shard_comm, replicate_comm), self.handles)
        self.kept = KeptGraph()
        if mp.buffer_dtype is not None:  # a buffer shared by several modules stays one tensor
            dtype = mp.buffer_dtype
            map_buffers(model, lambda buf: buf.to(dtype) if buf.is_floating_point() else buf)
        self._register_hooks()

    # ---- wiring -----------------------------------------------------------------------------------------------
    def _register_hooks(self) -> None:
        # The forward hooks gather, free and swap parameters and issue collectives: under torch.compile they run
        # eagerly (a graph break at each unit's edges, the layers between them compiled), as inductor cannot lower
        # what they do (record_stream, attribute swaps) and must not try.
        eager = eager_while_traced
        # A unit's hooks go first (prepend): a pre-hook the model had before wrapping (torch.nn.utils.weight_norm's,
        # which computes `weight` from `weight_g` and `weight_v`) then sees whole parameters, as in one process, and
        # every forward hook runs outside the unit, where what it saves is watched (outside_reads.py).
        units = [u for u in self.families if not u.is_root]
        for unit in units:
            for module in unit.modules:
                self.handles.append(module.register_forward_pre_hook(eager(self._make_pre_forward(unit)),
                                                                     with_kwargs=True, prepend=True))
            self.handles.append(unit.modules[-1].register_forward_hook(eager(self._make_post_forward(unit)),
                                                                       prepend=True))
        # Activation checkpointing of every k-th unit (k = 1: all of them), each unit's modules recomputed.
        for unit in every_kth(units, int(self.config.activation_checkpointing)):
            for module in unit.modules:
                checkpoint_module(module)
        register_outermost(self.model, eager(self._root_pre_forward), eager(self._make_post_forward(self.root)),
                           self.handles)  # a call the model makes inside its own (HF generate, routed) passes
        self.trainable = TrainableSet(self.units, lambda unit, info: lambda param: self._on_grad(unit, info),
                                      self.handles)  # follows requires_grad
        self.outside = OutsideReads(self.families, self._gather)  # parameters saved outside their unit's forward
        self.inner = InnerCalls(self.model, list(self.families), lambda u: u.entered or self.in_backward or (
            u.is_root and self.forward_running), self._pre_forward, self._post_forward, self.handles)  # inner_calls.py

    def _make_pre_forward(self, unit: Unit) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            with profiler_range("pre_forward", unit.label):
                return self._pre_forward(unit, args, kwargs)

        return hook

    def _make_post_forward(self, unit: Unit) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            with profiler_range("post_forward", unit.label):
                return self._post_forward(unit, output)

        return hook

    # ---- forward ----------------------------------------------------------------------------------------------
    def _root_pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        with profiler_range("root_pre_forward"):
            interrupted = self.in_backward and not inside_backward()  # a backward that raised part-way
            if self.forward_running or interrupted or any(u.entered for u in self.units):
                self._recover()
            self.forward_running = not self.in_backward
            if not self.in_backward:
                self.trainable.follow(self.accumulating, self.config.name)
                if self.forward_order:
                    self.order_recorded = True
            dtype = self.config.mixed_precision.param_dtype
            if dtype is not None:
                args, kwargs = cast_floating((args, kwargs), dtype)
            self._gather(self.root)
            self._swap_in(self.root)
            if not self.in_backward:
                self.outside.begin_forward()
            if self.config.prefetch and self.order_recorded and self.forward_order:
                self._start_gather(self.forward_order[0])
            return args, kwargs

    def _pre_forward(self, unit: Unit, args: tuple, kwargs: dict, prefetch: bool = True) -> tuple[tuple, dict]:
        if not self.in_backward and self._finished_forward is not None and self._finished_forward is not unit:
            self._reshard(self._finished_forward)  # before this unit's prefetch: still two units at most
        self._gather(unit)
        self._swap_in(unit)
        if self.in_backward:
            return args, kwargs  # recomputation (activation checkpointing) inside backward: make parameters whole
        if not self.order_recorded:
            if unit not in self.forward_pos:
                self.forward_pos[unit] = len(self.forward_order)
                self.forward_order.append(unit)
        elif prefetch and self.config.prefetch and unit in self.forward_pos:
            pos = self.forward_pos[unit]
            if pos + 1 < len(self.forward_order):
                self._start_gather(self.forward_order[pos + 1])
        if not unit.entered:
            unit.entered = True  # the first module of the unit: its inputs are the unit's inputs
            self.outside.enter_unit()
            if torch.is_grad_enabled() and not unit.keep_full:
                # Positional and keyword inputs alike: a unit called with keywords must free after its backward too.
                keys = list(kwargs)
                values = [*args, *(kwargs[k] for k in keys)]
                tensors = [a for a in values if isinstance(a, torch.Tensor) and a.requires_grad]
                if tensors:
                    marked = iter(MarkBackwardDone.apply(lambda: self._post_backward(unit), *tensors))
                    values = [next(marked) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in values]
                    args, kwargs = tuple(values[: len(args)]), dict(zip(keys, values[len(args):]))
        return args, kwargs

    def _post_forward(self, unit: Unit, output: Any) -> Any:
        was_entered, unit.entered = unit.entered, False
        if unit.is_root:
            self.forward_running = False
        if self.in_backward:
            return output
        if unit.is_root:
            self.outside.end_forward()
        elif was_entered:
            self.outside.leave_unit()
        grads_follow = torch.is_grad_enabled() and any(t.requires_grad for t in tensors_in(output))
        if grads_follow:
            for t in tensors_in(output):
                if t.requires_grad:
                    t.register_hook(self._make_pre_backward(unit))
        if unit.is_root and not self.order_recorded:
            self.launch_order = [part for u in (*reversed(self.forward_order), self.root) for part in self.families[u]]
            self.launch_order += [u for u in self.units if u not in self.launch_order]
        if not grads_follow:
            for part in self.families[unit]:
                part.swap_to_sharded()  # inference: nothing will need the unsharded parameters
                if not part.keep_full and not unit.is_root:
                    self._free(part)
        elif self.config.reshard_after_forward and not unit.is_root:
            if self._finished_forward is not None and self._finished_forward is not unit:
                self._reshard(self._finished_forward)
            if self.require_sync:
                self._finished_forward = unit
            else:
                self._reshard(unit)
        if unit.is_root and not grads_follow:
            self._finished_forward = None
            for other in self.units:
                other.swap_to_sharded()
                if not other.keep_full:
                    self._free(other)
        return output

    def _reshard(self, unit: Unit) -> None:
        """Free the unit's gathered parameters and put its shards back into the modules."""
        if unit is self._finished_forward:
            self._finished_forward = None
        for part in self.families[unit]:
            self._free(part)
            part.swap_to_sharded()

    def _free(self, part: Unit) -> None:
        if not self.kept.keeps:  # a graph built by a backward holds the gathered parameters (graph_gradients.py)
            part.free_full()

    # ---- backward ---------------------------------------------------------------------------------------------
    def _begin_backward(self) -> None:
        if self.in_backward:
            return
        self.in_backward = True
        self.kept.begin_backward()
        for unit in self.units:
            unit.begin_backward()
        if not self.launch_order:
            self.launch_order = list(self.units)
        self.next_launch = 0
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _make_pre_backward(self, unit: Unit) -> Any:
        def hook(grad: torch.Tensor) -> None:
            with profiler_range("pre_backward", unit.label):
                self._pre_backward(unit)

        return hook

    def _pre_backward(self, unit: Unit) -> None:
        self._begin_backward()
        if any(part.needs_gather() or not part.unsharded_in_modules for part in self.families[unit]):
            self._gather(unit)
            self._swap_in(unit)
        for part in self.families[unit]:
            part.prepare_grad_views()  # autograd accumulates into the flat gradient buffers directly
        if self.config.prefetch and unit in self.forward_pos:
            pos = self.forward_pos[unit]
            if pos > 0:
                self._start_gather(self.forward_order[pos - 1])

    def _on_grad(self, unit: Unit, info: ParamInfo) -> None:
        self._begin_backward()
        refuse_graph_accumulation(self.config.name, info.name)
        unit.refuse_late_gradient(self.config.name, info)
        unit.accumulate_grad(info)
        self._launch_ready()

    def _launch_ready(self) -> None:
        if not self.require_sync:
            return
        while self.next_launch < len(self.launch_order) and self.launch_order[self.next_launch].grad_pending == 0:
            self._start_reduce(self.launch_order[self.next_launch])
            self.next_launch += 1

    def _start_reduce(self, unit: Unit) -> None:
        with profiler_range("reduce_scatter", unit.label):
            unit.start_reduce()
        self._inflight.append(unit)
        self._drain(self.config.max_inflight_reductions)

    def _drain(self, limit: int) -> None:
        """Finish the oldest reductions until at most `limit` are in flight (the same order on every rank)."""
        while len(self._inflight) > limit:
            unit = self._inflight.popleft()
            with profiler_range("finish_reduce", unit.label):
                unit.finish_reduce()

    def _post_backward(self, unit: Unit) -> None:
        if not unit.keep_full and not unit.is_root:
            self._reshard(unit)

    def _finish_backward(self) -> None:
        with profiler_range("finish_backward"):
            try:
                if self.kept.building:
                    return  # autograd.grad(..., create_graph=True): no gradient accumulated, nothing to reduce
                for unit in self.launch_order:
                    unit.flush_unused()  # parameters that got no gradient this pass contribute zeros
                if self.require_sync:
                    self._launch_ready()
                    self._drain(0)
                    self.replicated.reduce()
                self.accumulating = not self.require_sync
            finally:
                self._finished_forward = None
                self.kept.end_backward()
                for unit in self.units:
                    unit.swap_to_sharded()
                    if not unit.keep_full:
                        self._free(unit)
                self.in_backward = False

    def _recover(self) -> None:
        """A previous forward or backward raised part-way (the autograd callback that ends a backward never ran):
        wait for what was issued, drop the partial gradients, reshard, so the next step starts clean."""
        for unit in self.units:
            unit.abandon()
        agree_on_recovery(self.comm, "ZeRO/FSDP")
        self._inflight.clear()
        self._finished_forward = None
        self.in_backward = self.forward_running = self.accumulating = False
        self.kept = KeptGraph()
        self.outside.reset()
        self.next_launch = 0

    def sync_gradients(self) -> None:
        """Reduce what backward passes under `no_sync()` accumulated, now: every unit's reduce-scatter (in launch
        order, the same on every rank) and the replicated parameters' all-reduce. A pipeline calls it once per
        step, after its last microbatch."""
        if not self.launch_order:
            self.launch_order = list(self.units)
        for unit in self.launch_order:
            self._start_reduce(unit)
        self._drain(0)
        self.replicated.reduce()
        self.accumulating = False

    # ---- gathering (a whole family: the same order on every rank) ---------------------------------------------
    def _start_gather(self, unit: Unit) -> None:
        for part in self.families[unit]:
            part.start_gather()

    def _gather(self, unit: Unit) -> None:
        for part in self.families[unit]:
            part.start_gather()  # both issued before either is waited for
        for part in self.families[unit]:
            part.wait_gather()

    def _swap_in(self, unit: Unit) -> None:
        for part in self.families[unit]:
            part.swap_to_unsharded()

    @property
    def gathered_peak(self) -> int:
        return self.memory.peak
