"""Local SGD and DiLoCo: every worker takes H optimizer steps on its own, then the workers meet once.

Mechanism (Stich, "Local SGD Converges Fast and Communicates Little", ICLR 2019; Douillard et al., "DiLoCo:
Distributed Low-Communication Training of Language Models", arXiv 2311.08105)
------------------------------------------------------------------------------------------------------------
* At wrap time rank 0's parameters and buffers are broadcast, so every replica starts equal, and (with an outer
  optimizer) a copy of them is kept: the *anchor*, the global parameters of the last synchronisation.
* Between synchronisations each worker trains alone: `loss.backward(); opt.step()` with its own inner optimizer
  (any torch.optim, built over `model.parameters()` after wrapping, exactly as for a single process). Nothing is
  communicated: no gradient hook, no collective.
* Every `sync_every`-th call of `model.step()` (after `opt.step()`) synchronises, a collective over `comm`:
  - without an outer optimizer (plain local SGD, "model averaging"): the parameters are averaged;
  - with one (DiLoCo): the *outer gradient* `anchor - local` (how far this worker moved, sign as a gradient) is
    averaged over the workers, written to the anchors' `.grad`, and the outer optimizer steps the anchors; every
    worker then continues from the new anchor. DiLoCo's outer optimizer is SGD with Nesterov momentum (lr 0.7,
    momentum 0.9); an outer SGD with lr 1 and no momentum is exactly plain averaging.
  Both send one coalesced all-reduce per dtype (parameters, then floating-point buffers such as BatchNorm
  statistics, which are averaged as values): 2(N-1)/N x model bytes per rank, once every H steps instead of
  every step (H x fewer bytes than DDP).
* The inner optimizer's state (Adam moments) is each worker's own and is never synchronised, as in DiLoCo.
* `compression=` sends the outer gradients compressed by a `sw.compression` method (FP16, BF16, TopK, RandomK,
  PowerSGD, OneBit), each with its error-feedback memory on each rank (what a sync did not send joins the next
  one's outer gradient), as in DiLoCo's follow-ups that quantise or sparsify the outer gradient (Douillard et al.
  2025, Streaming DiLoCo, arXiv 2501.18512: fp4 outer gradients). Only outer gradients are compressed, never
  values: plain averaging with compression keeps anchors and steps them with outer SGD at lr 1 (the same
  update), and floating-point buffers are averaged exactly in their own all-reduce. One bucket per dtype, keyed
  "outer/<k>", with the parameters' shapes (PowerSGD compresses each matrix).
* `reduce=` is the lower-level extension point: a callable `reduce(comm, flat)` that must leave the average over
  `comm` of every rank's flat tensor in `flat` (the default is `comm.all_reduce(flat, AVG)`).

With an inner SGD without momentum and H = 1, plain averaging (or an outer SGD with lr 1 and no momentum) is the
same update as DDP: the mean of `p - lr g_i` is `p - lr mean(g_i)`.

Non-finite values (finite.py): an averaged result holding inf or nan raises NonFiniteStateError on every rank, naming
the parameter, before it is written anywhere, so the anchors and the outer momentum stay finite. A step skipped by a
loss scaler is not counted as an inner step (the optimizer did not step), also when the loop calls `model.step()`
after `scaler.step(opt)` with a scaler built from the model, which tells the model the step was skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._mixin import MovesRefused, mix_in
from ..agreement import check_agreement, describe_parameters
from ..comm.base import Communicator, ReduceOp
from ..comm.coalesced import broadcast_coalesced
from ..compression.base import Compressor
from ..placement import to_comm_device
from ..sharded_tensor import local
from ..requires_grad_at_wrap import RequiresGradAtWrap
from .checks import check_anchor_names, check_comm, check_positive_int, check_whole_model
from .extra_state import declare_local_sgd
from .finite import check_averaged
from .flat import group_by_dtype, pack, unpack
from .step_hook import register_counting, take_counted

__all__ = ["LocalSGD", "LocalSGDModule", "OuterOptimizerFactory", "Reduce"]

log = logging.getLogger("shardwise.async_sgd")

OuterOptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
Reduce = Callable[[Communicator, torch.Tensor], None]


def _average(comm: Communicator, flat: torch.Tensor) -> None:
    comm.all_reduce(flat, ReduceOp.AVG)


class _State:
    """Per-model local SGD state: what is averaged, the anchors and the outer optimizer, the step counters."""

    def __init__(self, module: nn.Module, comm: Communicator, sync_every: int,
                 outer_optimizer: OuterOptimizerFactory | None, reduce: Reduce,
                 compressor: Compressor | None = None) -> None:
        self.comm = comm
        self.sync_every = sync_every
        self.reduce = reduce
        self.compressor = compressor  # this rank's own copy (its error-feedback memory is this rank's)
        if compressor is not None and outer_optimizer is None:
            # Compress differences, never values: averaging is outer SGD at lr 1 on the averaged outer gradient.
            def outer_optimizer(ps: list[torch.Tensor]) -> torch.optim.Optimizer:
                return torch.optim.SGD(ps, lr=1.0)
        self.method = "LocalSGD"  # how errors name it (sw.DiLoCo says "DiLoCo")
        self.names = [n for n, p in module.named_parameters() if p.requires_grad]
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.at_wrap = RequiresGradAtWrap(module)  # a change of that set is refused at the next inner step
        self.buffer_names = [n for n, b in module.named_buffers() if b.is_floating_point()]
        self.buffers = [b for b in module.buffers() if b.is_floating_point()]
        # Parameters and floating buffers travel together: one all-reduce per dtype.
        self.groups = group_by_dtype([*self.params, *self.buffers])
        self.anchors: list[torch.Tensor] = []
        self.outer: torch.optim.Optimizer | None = None
        if outer_optimizer is not None:
            self.anchors = [p.detach().clone() for p in self.params]
            self.outer = outer_optimizer(self.anchors)
            if not isinstance(self.outer, torch.optim.Optimizer):
                raise ValueError(f"LocalSGD: outer_optimizer must return a torch.optim.Optimizer over the tensors it "
                                 f"is given, got {type(self.outer).__name__}")
        self.inner_steps = 0
        self.syncs = 0

    @torch.no_grad()
    def sync(self) -> None:
        if self.compressor is not None:
            self._sync_compressed()
            return
        n_params = len(self.params)
        flats = []
        for group in self.groups:
            # Parameters send their outer gradient (anchor - local) with an outer optimizer, else their value.
            parts = []
            for i in group:
                if i >= n_params:
                    parts.append(self.buffers[i - n_params])
                elif self.outer is not None:
                    parts.append(self.anchors[i] - self.params[i])
                else:
                    parts.append(self.params[i])
            flat = pack(parts)
            self.reduce(self.comm, flat)
            flats.append(flat)
        what = "outer gradient" if self.outer is not None else "parameters"
        check_averaged(self.method, [what] * len(flats), flats, [self._members(g) for g in self.groups],
                       self._at())
        for group, flat in zip(self.groups, flats):
            targets = []
            for i in group:
                if i >= n_params:
                    targets.append(self.buffers[i - n_params])
                elif self.outer is not None:
                    anchor = self.anchors[i]
                    if anchor.grad is None:
                        anchor.grad = torch.empty_like(anchor)
                    targets.append(anchor.grad)
                else:
                    targets.append(self.params[i])
            unpack(flat, targets)
        if self.outer is not None:
            self.outer.step()
            for p, anchor in zip(self.params, self.anchors):
                p.copy_(anchor)
        self.syncs += 1

    def _members(self, group: list[int]) -> list[tuple[str, int]]:
        """(name, numel) of what a packed group holds, parameters' indices first then buffers' (offset by their
        count), for naming a non-finite value."""
        n = len(self.params)
        return [(self.names[i], self.params[i].numel()) if i < n else
                (self.buffer_names[i - n], self.buffers[i - n].numel()) for i in group]

    def _at(self) -> str:
        return f"sync {self.syncs + 1} (inner step {self.inner_steps})"

    @torch.no_grad()
    def _sync_compressed(self) -> None:
        """Outer gradients through the compressor (one bucket per dtype), buffers averaged exactly apart."""
        assert self.compressor is not None and self.outer is not None
        n = len(self.params)
        param_groups = group_by_dtype(self.params)
        buffer_groups = [[n + i for i in g] for g in group_by_dtype(self.buffers)]
        flats = []
        for k, group in enumerate(param_groups):
            deltas = [self.anchors[i] - self.params[i] for i in group]
            flat = pack(deltas)
            self.compressor.reduce(f"outer/{k}", flat, self.comm, [d.shape for d in deltas]).wait()
            flats.append(flat)
        for group in buffer_groups:
            flat = pack([self.buffers[i - n] for i in group])
            self.comm.all_reduce(flat, ReduceOp.AVG)
            flats.append(flat)
        # One host read: the averaged results and the compressor's new state (restored if any is not finite).
        check_averaged(self.method, ["outer gradient"] * len(param_groups) + ["buffers"] * len(buffer_groups), flats,
                       [self._members(g) for g in (*param_groups, *buffer_groups)], self._at(), self.compressor)
        for group, flat in zip(param_groups, flats):
            for i in group:
                if self.anchors[i].grad is None:
                    self.anchors[i].grad = torch.empty_like(self.anchors[i])
            unpack(flat, [self.anchors[i].grad for i in group])
        for group, flat in zip(buffer_groups, flats[len(param_groups):]):
            unpack(flat, [self.buffers[i - n] for i in group])
        self.outer.step()
        for p, anchor in zip(self.params, self.anchors):
            p.copy_(anchor)
        self.syncs += 1


class LocalSGDModule(MovesRefused):
    """Mixed into a module's class by `LocalSGD`: adds `step()`, `sync()` and the outer state's (de)serialisation."""

    _local_sgd: _State

    def step(self) -> bool:
        """Count one inner step; every `sync_every`-th count synchronises the workers (collective) and returns True.

        Not needed in a plain loop: the inner optimizer's `step()` counts (step_hook.py). Right after it, this
        returns what that count returned without counting again; without one (an update by hand) it counts."""
        counted = take_counted(self)
        return self._advance() if counted is None else counted

    def _advance(self) -> bool:
        state = self._local_sgd
        state.at_wrap.check(state.method)
        state.inner_steps += 1
        if state.inner_steps % state.sync_every == 0:
            state.sync()
            return True
        return False

    def sync(self) -> None:
        """Synchronise now (collective), e.g. before an evaluation or the end of training; the count restarts."""
        self._local_sgd.sync()

    @property
    def sync_every(self) -> int:
        return self._local_sgd.sync_every

    @property
    def inner_steps(self) -> int:
        """Calls of `step()` so far (including those restored by `load_outer_state_dict`)."""
        return self._local_sgd.inner_steps

    @property
    def syncs(self) -> int:
        """Synchronisations so far."""
        return self._local_sgd.syncs

    @property
    def compressor(self) -> Compressor | None:
        """This rank's outer-gradient compressor (with its error-feedback memory), or None."""
        return self._local_sgd.compressor

    @property
    def outer_optimizer(self) -> torch.optim.Optimizer | None:
        """The outer optimizer (over the anchors), or None for plain averaging."""
        return self._local_sgd.outer

    def outer_state_dict(self) -> dict[str, Any]:
        """The state local SGD adds to the model and the inner optimizer: step counters, anchors (by parameter
        name) and the outer optimizer's state_dict. Equal on every rank. Tensors and plain values only, so
        `torch.save` / `torch.load(..., weights_only=True)` round-trip it without unpickling code."""
        state = self._local_sgd
        return {"sync_every": state.sync_every, "inner_steps": state.inner_steps, "syncs": state.syncs,
                "anchors": {n: a.detach().clone() for n, a in zip(state.names, state.anchors)},
                "outer_optimizer": None if state.outer is None else state.outer.state_dict()}

    @torch.no_grad()
    def load_outer_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore `outer_state_dict()`'s output (after loading the model and inner optimizer). ValueError when it
        was saved with or without an outer optimizer unlike this wrapper, or for other parameters."""
        state = self._local_sgd
        has_outer = saved.get("outer_optimizer") is not None
        if has_outer != (state.outer is not None):
            raise ValueError(f"load_outer_state_dict: the state was saved {'with' if has_outer else 'without'} an "
                             f"outer optimizer but this LocalSGD has {'one' if state.outer is not None else 'none'}")
        anchors = saved.get("anchors", {})
        if state.outer is not None:
            check_anchor_names(anchors, state.names, "load_outer_state_dict")
            for name, anchor in zip(state.names, state.anchors):
                anchor.copy_(anchors[name])
            state.outer.load_state_dict(saved["outer_optimizer"])
        state.inner_steps = int(saved["inner_steps"])
        state.syncs = int(saved["syncs"])


def LocalSGD(
    module: nn.Module,
    comm: Communicator,
    *,
    sync_every: int,
    outer_optimizer: OuterOptimizerFactory | None = None,
    reduce: Reduce | None = None,
    compression: Compressor | None = None,
) -> nn.Module:
    """Train `module` with local SGD over `comm` and return it (the same object, parameter names unchanged).

    sync_every: H, the inner steps between synchronisations (1 = every step).
    outer_optimizer: None for plain parameter averaging, or a callable building a torch.optim optimizer over the
        list of anchor tensors it is given (DiLoCo: `lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9,
        nesterov=True)`, which `sw.DiLoCo` builds for you).
    reduce: `reduce(comm, flat)` leaves the average over `comm` of every rank's `flat` in place (default: one
        all-reduce AVG); a lower-level extension point than `compression`.
    compression: a `sw.compression` method (e.g. `sw.compression.TopK(ratio=0.01)`) that sends the outer gradients
        (anchor - local) compressed, with error feedback per rank; buffers stay exact. Without an outer optimizer
        the anchors are kept and stepped by outer SGD at lr 1 (plain averaging of the decompressed deltas).
    Loop: `loss.backward(); opt.step(); opt.zero_grad()` with any torch.optim inner optimizer built over
    `model.parameters()` after wrapping: its step counts the inner steps (step_hook.py); `model.step()` after it is
    allowed and does not count twice. See the module docstring for what a synchronisation does.
    """
    comm = check_comm(comm, "LocalSGD")
    check_whole_model(module, comm, "LocalSGD")
    if isinstance(module, LocalSGDModule):
        raise ValueError("LocalSGD: the module is already wrapped by LocalSGD; wrap the plain module once")
    sync_every = check_positive_int(sync_every, "sync_every", "LocalSGD")
    if outer_optimizer is not None and not callable(outer_optimizer):
        raise ValueError(f"LocalSGD: outer_optimizer={outer_optimizer!r} must be None (plain averaging) or a callable "
                         f"taking a list of tensors and returning a torch.optim.Optimizer")
    if reduce is not None and not callable(reduce):
        raise ValueError(f"LocalSGD: reduce={reduce!r} must be None or a callable reduce(comm, flat_tensor)")
    if compression is not None and not isinstance(compression, Compressor):
        raise ValueError(f"LocalSGD: compression={compression!r} must be None or a sw.compression method (FP16(), "
                         f"BF16(), TopK(ratio), RandomK(ratio), PowerSGD(rank), OneBit())")
    if compression is not None and reduce is not None:
        raise ValueError("LocalSGD: give compression= or reduce=, not both (compression is a reduce of its own)")
    if not any(p.requires_grad for p in module.parameters()):
        raise ValueError("LocalSGD: the module has no trainable parameter (requires_grad=True): nothing to average")
    to_comm_device(module, comm, "LocalSGD")
    check_agreement(comm, "LocalSGD", {"parameters": describe_parameters(module), "options": {
        "sync_every": sync_every, "outer_optimizer": outer_optimizer is not None,
        "compression": None if compression is None else compression.config()}})
    if comm.size > 1:
        with torch.no_grad():
            broadcast_coalesced(comm, [local(p.data) for p in module.parameters()] + [b.data for b in module.buffers()])
    state = _State(module, comm, sync_every, outer_optimizer, reduce or _average,
                   None if compression is None else compression.fresh())
    mix_in(module, LocalSGDModule, "LocalSGD")
    module._local_sgd = state
    register_counting(module)  # the inner optimizer's step counts (step_hook.py)
    # Declared to the layout contract: its outer state travels in sw.save_checkpoint (extra_state.py).
    declare_local_sgd(module, comm, {"sync_every": sync_every, "outer_optimizer": state.outer is not None,
                                     "compression": None if compression is None else compression.config()})
    log.debug("LocalSGD over %d ranks: sync every %d steps, outer optimizer %s", comm.size, sync_every,
              type(state.outer).__name__ if state.outer is not None else "none (averaging)")
    return module

