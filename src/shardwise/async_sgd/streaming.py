"""Streaming DiLoCo: DiLoCo whose synchronisation is split into fragments on a staggered schedule, each fragment's
all-reduce overlapped with the next inner steps (Douillard et al. 2025, "Streaming DiLoCo with overlapping
communication: Towards a Distributed Free Lunch", arXiv 2501.18512).

Mechanism, per worker (every rank runs the same schedule, so the collectives match)
-----------------------------------------------------------------------------------
* The trainable parameters are split into F fragments of whole layer blocks (fragments.py: "sequential" runs of
  blocks of about equal bytes, or "strided"). Each fragment has its own anchors (the global parameters of its last
  synchronisation) and its own outer optimizer (SGD, Nesterov momentum: DiLoCo's), so its momentum is its own.
* Fragment f synchronises every H inner steps, at steps t = o_f, o_f + H, o_f + 2H, ... with o_f = (f+1) H / F
  (rounded down): a fragment starts every H/F steps, so the peak bytes of one synchronisation are ~1/F of DiLoCo's
  while the bytes per H steps are the same (the paper's "streaming partial updates", Section 2.2).
* At its step t the fragment's outer gradient `anchor - local` (and its floating-point buffers' values) is packed
  and all-reduced (AVG) with `async_op=True`: the worker keeps training (the paper's overlap, Section 2.3).
* tau = `overlap_steps` inner steps later the worker waits for the result, steps the fragment's outer optimizer on
  the anchors and merges: local <- alpha * local + (1 - alpha) * new_global (the paper's mixing of the local
  parameters, which moved for tau more steps, with the synchronised ones, Section 2.3). The default alpha = 0
  replaces the local fragment by the new global one, as DiLoCo does and as torchft's implementation defaults
  (`fragment_update_alpha=0`); in docs/async.md's runs an even mix (0.5) cost 5-6% of held-out loss against
  replacement, with tau = 1 and tau = 4 alike.
* tau < H, so a fragment has at most one synchronisation in flight; several fragments may be in flight at once
  when tau >= H/F. With F = 1 and tau = 0 this is `sw.DiLoCo` step for step, bit for bit (tested).
* `compression=` sends each fragment's outer gradients through a `sw.compression` method (the paper quantises
  them to 4 bits), with the compressor's own asynchronous reduce: one bucket per fragment and dtype, error feedback
  on each rank; floating-point buffers are then averaged exactly in their own all-reduce.
* `model.sync()` completes the synchronisations in flight and then synchronises every fragment at once, blocking,
  with the local parameters replaced: afterwards the replicas are equal (an evaluation, the end of training).

State (streaming_state.py): counters, anchors, each fragment's outer optimizer state and the in-flight results (a
save waits for them: they are the same on every rank) are "replicated" extra state; each worker's own parameters,
which differ between synchronisations, are "per_rank" extra state. `sw.save_checkpoint` therefore resumes the run
exactly on the same world size; the inner optimizer's state is the user's (one copy in the checkpoint).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import nn

from .._mixin import mix_in
from ..agreement import check_agreement, describe_parameters
from ..comm.base import Communicator, ReduceOp, Work
from ..comm.coalesced import broadcast_coalesced
from ..compression.base import Compressor
from ..placement import to_comm_device
from ..sharded_tensor import local
from ..requires_grad_at_wrap import RequiresGradAtWrap
from .checks import check_comm, check_positive_int, check_whole_model
from .finite import check_averaged
from .flat import group_by_dtype, pack, unpack
from .fragments import split_fragments
from .local_sgd import LocalSGDModule
from .step_hook import register_counting
from .streaming_state import declare_streaming

__all__ = ["StreamingDiLoCo", "StreamingDiLoCoModule"]

log = logging.getLogger("shardwise.async_sgd")


@dataclasses.dataclass
class _Fragment:
    index: int
    offset: int  # the first inner step at which it synchronises; then every H steps
    params: list[int]  # indices into the state's params
    buffers: list[int]  # indices into the state's buffers
    groups: list[list[int]]  # per dtype: indices into [*params, *buffers] of the whole model (params first)
    outer: torch.optim.Optimizer


@dataclasses.dataclass
class _Pending:
    due: int  # the inner step at which the result is applied
    flats: list[torch.Tensor]  # one per dtype group: the averaged outer gradients (and buffer values)
    works: list[Work | None]  # None once waited for


class _StreamingState:
    """Per-model streaming state: fragments, anchors, per-fragment outer optimizers, the syncs in flight."""

    def __init__(self, module: nn.Module, comm: Communicator, sync_every: int, fragments: int, overlap: int,
                 alpha: float, pattern: str, outer_lr: float, outer_momentum: float, nesterov: bool,
                 compressor: Compressor | None = None) -> None:
        self.comm = comm
        self.compressor = compressor  # this rank's own (its error-feedback memory is this rank's)
        self.sync_every = sync_every
        self.overlap = overlap
        self.alpha = alpha
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.at_wrap = RequiresGradAtWrap(module)  # a change of that set is refused at the next inner step
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        named_buffers = [(n, b) for n, b in module.named_buffers() if b.is_floating_point()]
        self.buffer_names = [n for n, _ in named_buffers]
        self.buffers = [b for _, b in named_buffers]
        parts = split_fragments(self.names, [p.numel() * p.element_size() for p in self.params], fragments, pattern)
        self.anchors = [p.detach().clone() for p in self.params]
        blocks: dict[str, int] = {}
        for f, part in enumerate(parts):
            for i in part:
                blocks.setdefault(self.names[i].rsplit(".", 1)[0], f)
        n = len(self.params)
        self.fragments: list[_Fragment] = []
        for f, part in enumerate(parts):
            # A buffer travels with the fragment of its module's parameters (BatchNorm with its weights), else with
            # the last fragment, once every H steps like DiLoCo.
            bufs = [j for j, (name, _) in enumerate(named_buffers)
                    if blocks.get(name.rsplit(".", 1)[0], fragments - 1) == f]
            if compressor is None:  # parameters and buffers in one all-reduce per dtype, as DiLoCo
                members = [*part, *(n + j for j in bufs)]
                tensors = [self.params[i] if i < n else self.buffers[i - n] for i in members]
                groups = [[members[k] for k in g] for g in group_by_dtype(tensors)]
            else:  # outer gradients through the compressor, one bucket per dtype; buffers averaged exactly apart
                groups = [[part[k] for k in g] for g in group_by_dtype([self.params[i] for i in part])]
                groups += [[n + bufs[k] for k in g] for g in group_by_dtype([self.buffers[j] for j in bufs])]
            outer = torch.optim.SGD([self.anchors[i] for i in part], lr=outer_lr, momentum=outer_momentum,
                                    nesterov=nesterov and outer_momentum > 0)
            self.fragments.append(_Fragment(f, (f + 1) * sync_every // fragments, list(part), bufs, groups, outer))
        self.pending: dict[int, _Pending] = {}
        self.inner_steps = 0
        self.syncs = 0  # fragment synchronisations applied

    def _part(self, i: int) -> torch.Tensor:
        n = len(self.params)
        return self.buffers[i - n] if i >= n else self.anchors[i] - self.params[i]

    def bucket_key(self, frag: _Fragment, k: int) -> str:
        """The compressor's bucket for the fragment's k-th dtype group: LocalSGD's "outer/<k>" with one fragment
        (so F = 1, tau = 0 with compression is DiLoCo with compression, bit for bit), else "outer/<f>/<k>"."""
        return f"outer/{k}" if len(self.fragments) == 1 else f"outer/{frag.index}/{k}"

    def compressed_buckets(self) -> list[int]:
        """Elements of every compressed bucket, in fragment and dtype order (the compressor's checkpoint config)."""
        n = len(self.params)
        return [sum(self.params[i].numel() for i in g) for f in self.fragments for g in f.groups if g[0] < n]

    @torch.no_grad()
    def start(self, frag: _Fragment, due: int) -> None:
        """Pack the fragment's outer gradient (and buffer values) and all-reduce it asynchronously (compressed
        outer gradients through the compressor's own asynchronous reduce)."""
        flats, works = [], []
        n = len(self.params)
        for k, group in enumerate(frag.groups):
            parts = [self._part(i) for i in group]
            flat = pack(parts)
            if self.compressor is not None and group[0] < n:
                works.append(self.compressor.reduce(self.bucket_key(frag, k), flat, self.comm,
                                                    [t.shape for t in parts]))
            else:
                works.append(self.comm.all_reduce(flat, ReduceOp.AVG, async_op=True))
            flats.append(flat)
        self.pending[frag.index] = _Pending(due, flats, works)

    @staticmethod
    def wait(pending: _Pending) -> None:
        for k, work in enumerate(pending.works):
            if work is not None:
                work.wait()
                pending.works[k] = None

    @torch.no_grad()
    def finish(self, frag: _Fragment, alpha: float) -> None:
        """Wait for the fragment's all-reduce, step its outer optimizer, merge the new global values locally."""
        pending = self.pending.pop(frag.index)
        self.wait(pending)
        n = len(self.params)
        # Nothing non-finite reaches the anchors or the outer momentum (finite.py): raises on every rank alike.
        check_averaged("StreamingDiLoCo", ["outer gradient" if g[0] < n else "buffers" for g in frag.groups],
                       pending.flats, [[(self.names[i], self.params[i].numel()) if i < n else (
                           self.buffer_names[i - n], self.buffers[i - n].numel()) for i in g] for g in frag.groups],
                       f"fragment {frag.index}'s sync (inner step {self.inner_steps})")
        for group, flat in zip(frag.groups, pending.flats):
            targets = []
            for i in group:
                if i >= n:
                    buffer = self.buffers[i - n]
                    targets.append(buffer if alpha == 0 else torch.empty_like(buffer))
                else:
                    anchor = self.anchors[i]
                    if anchor.grad is None:
                        anchor.grad = torch.empty_like(anchor)
                    targets.append(anchor.grad)
            unpack(flat, targets)
            if alpha != 0:
                for i, target in zip(group, targets):
                    if i >= n:
                        self.buffers[i - n].lerp_(target, 1 - alpha)
        frag.outer.step()
        for i in frag.params:
            if alpha == 0:
                self.params[i].copy_(self.anchors[i])  # exact: DiLoCo's replacement, bit for bit
            else:
                self.params[i].lerp_(self.anchors[i], 1 - alpha)  # alpha * local + (1 - alpha) * global
        self.syncs += 1

    def step(self) -> bool:
        self.inner_steps += 1
        t = self.inner_steps
        for frag in self.fragments:
            if t >= frag.offset and (t - frag.offset) % self.sync_every == 0:
                self.start(frag, t + self.overlap)
        applied = False
        for frag in self.fragments:  # fragment order: the same on every rank
            pending = self.pending.get(frag.index)
            if pending is not None and pending.due == t:
                self.finish(frag, self.alpha)
                applied = True
        return applied

    def sync(self) -> None:
        for frag in sorted(self.fragments, key=lambda f: self.pending[f.index].due if f.index in self.pending else 0):
            if frag.index in self.pending:
                self.finish(frag, self.alpha)
        for frag in self.fragments:
            self.start(frag, self.inner_steps)
            self.finish(frag, 0.0)

    def settle(self) -> None:
        """Wait for every all-reduce in flight (results unchanged, applied at their due step): before a save."""
        for pending in self.pending.values():
            self.wait(pending)


class StreamingDiLoCoModule(LocalSGDModule):
    """Mixed into a module's class by `StreamingDiLoCo`: `step()`, `sync()`, the fragments and the outer state."""

    _local_sgd: _StreamingState  # type: ignore[assignment]

    def _advance(self) -> bool:
        """Count one inner step: start the all-reduce of every fragment due to synchronise now and apply those whose
        overlap has elapsed (collectives). True when an outer update was applied at this step. The inner optimizer's
        step calls it (step_hook.py); `model.step()` after that returns its result."""
        self._local_sgd.at_wrap.check("StreamingDiLoCo")
        return self._local_sgd.step()

    def sync(self) -> None:
        """Complete the synchronisations in flight, then synchronise every fragment now (blocking, local values
        replaced): the replicas are equal afterwards. For an evaluation or the end of training (collective)."""
        self._local_sgd.sync()

    @property
    def outer_optimizer(self) -> torch.optim.Optimizer | None:
        """The outer optimizer with one fragment; with several use `outer_optimizers` (ValueError)."""
        frags = self._local_sgd.fragments
        if len(frags) != 1:
            raise ValueError(f"StreamingDiLoCo has {len(frags)} fragments, each with its own outer optimizer: "
                             f"use model.outer_optimizers")
        return frags[0].outer

    @property
    def outer_optimizers(self) -> tuple[torch.optim.Optimizer, ...]:
        """Each fragment's outer optimizer (SGD with Nesterov momentum over its anchors), in fragment order."""
        return tuple(f.outer for f in self._local_sgd.fragments)

    @property
    def fragments(self) -> list[dict[str, Any]]:
        """Each fragment's parameter names, first synchronisation step and bytes, in fragment order."""
        state = self._local_sgd
        return [{"names": [state.names[i] for i in f.params], "offset": f.offset,
                 "bytes": sum(state.params[i].numel() * state.params[i].element_size() for i in f.params)}
                for f in state.fragments]

    @property
    def overlap_steps(self) -> int:
        return self._local_sgd.overlap

    @property
    def alpha(self) -> float:
        return self._local_sgd.alpha

    @property
    def in_flight(self) -> dict[int, int]:
        """Fragments whose synchronisation is in flight, with the inner step at which each is applied."""
        return {f: p.due for f, p in sorted(self._local_sgd.pending.items())}

    def outer_state_dict(self) -> dict[str, Any]:
        """Counters, anchors (by parameter name), each fragment's outer optimizer state and the synchronisations in
        flight (waited for first: their averaged results, equal on every rank, and the step each is due). Tensors
        and plain values only (torch.load(..., weights_only=True) round-trips it)."""
        state = self._local_sgd
        state.settle()
        return {"sync_every": state.sync_every, "fragments": len(state.fragments), "overlap_steps": state.overlap,
                "inner_steps": state.inner_steps, "syncs": state.syncs,
                "anchors": {n: a.detach().clone() for n, a in zip(state.names, state.anchors)},
                "outer_optimizers": [f.outer.state_dict() for f in state.fragments],
                "pending": {f: {"due": p.due, "flats": [t.clone() for t in p.flats]}
                            for f, p in sorted(state.pending.items())}}

    @torch.no_grad()
    def load_outer_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore `outer_state_dict()`'s output (after the model and the inner optimizer). ValueError naming what
        does not fit this wrapper (fragments, overlap, anchors, in-flight buffers), before anything changes."""
        from .streaming_state import check_outer

        check_outer(self, saved)
        state = self._local_sgd
        state.settle()
        for name, anchor in zip(state.names, state.anchors):
            anchor.copy_(saved["anchors"][name])
        for frag, outer in zip(state.fragments, saved["outer_optimizers"]):
            frag.outer.load_state_dict(outer)
        state.pending = {int(f): _Pending(int(p["due"]), [t.clone() for t in p["flats"]], [None] * len(p["flats"]))
                         for f, p in saved["pending"].items()}
        state.inner_steps = int(saved["inner_steps"])
        state.syncs = int(saved["syncs"])


def _check_number(value: object, name: str, low: float, high: float, high_open: bool = True) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value and (
        value < high if high_open else value <= high)
    if not ok:
        raise ValueError(f"StreamingDiLoCo: {name}={value!r} must be a number in [{low:g}, {high:g}"
                         f"{')' if high_open else ']'}")
    return float(value)


def StreamingDiLoCo(
    module: nn.Module,
    comm: Communicator,
    *,
    sync_every: int = 500,
    fragments: int = 1,
    overlap_steps: int = 0,
    alpha: float = 0.0,
    pattern: str = "sequential",
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    nesterov: bool = True,
    compression: Compressor | None = None,
) -> nn.Module:
    """Train `module` with Streaming DiLoCo over `comm` and return it (the same object, names unchanged).

    sync_every: H, the inner steps between two synchronisations of the same fragment.
    fragments: F, the groups of layer blocks synchronised at different steps (1 to the number of blocks, at most H).
    overlap_steps: tau, the inner steps a fragment's all-reduce overlaps before it is applied (0 to H - 1).
    alpha: the weight of the local values when merging: local <- alpha local + (1 - alpha) global, in [0, 1);
        0 (the default) replaces them, as DiLoCo does.
    pattern: "sequential" (consecutive blocks of about equal bytes) or "strided" (block i in fragment i % F).
    outer_lr, outer_momentum, nesterov: each fragment's outer SGD (DiLoCo's defaults: 0.7, Nesterov 0.9).
    compression: a `sw.compression` method for the outer gradients (the paper quantises them), one bucket per
        fragment and dtype with its error feedback on each rank; buffers stay exact.
    Loop: `loss.backward(); opt.step(); opt.zero_grad()` (the optimizer's step counts; `model.step()` after it is
    allowed); `model.sync()` before evaluating the global
    model. See the module docstring for the schedule and what is sent.
    """
    who = "StreamingDiLoCo"
    comm = check_comm(comm, who)
    check_whole_model(module, comm, who)
    if isinstance(module, LocalSGDModule):
        raise ValueError(f"{who}: the module is already wrapped by LocalSGD / DiLoCo; wrap the plain module once")
    sync_every = check_positive_int(sync_every, "sync_every", who)
    fragments = check_positive_int(fragments, "fragments", who)
    if fragments > sync_every:
        raise ValueError(f"{who}: fragments={fragments} must be at most sync_every={sync_every} (each fragment starts "
                         f"at its own step within H); allowed: 1 to {sync_every}")
    if isinstance(overlap_steps, bool) or not isinstance(overlap_steps, int) or not 0 <= overlap_steps < sync_every:
        raise ValueError(f"{who}: overlap_steps={overlap_steps!r} must be an int in [0, sync_every) = [0, "
                         f"{sync_every}) (a fragment's result must land before its next synchronisation starts)")
    alpha = _check_number(alpha, "alpha", 0, 1)
    if isinstance(outer_lr, bool) or not isinstance(outer_lr, (int, float)) or not outer_lr > 0:
        raise ValueError(f"{who}: outer_lr={outer_lr!r} must be a number > 0")
    _check_number(outer_momentum, "outer_momentum", 0, 1)
    if not isinstance(nesterov, bool):
        raise ValueError(f"{who}: nesterov={nesterov!r} must be True or False")
    if compression is not None and not isinstance(compression, Compressor):
        raise ValueError(f"{who}: compression={compression!r} must be None or a sw.compression method (FP16(), "
                         f"BF16(), TopK(ratio), RandomK(ratio), PowerSGD(rank), OneBit())")
    if not any(p.requires_grad for p in module.parameters()):
        raise ValueError(f"{who}: the module has no trainable parameter (requires_grad=True): nothing to synchronise")
    to_comm_device(module, comm, who)
    options = {"sync_every": sync_every, "fragments": fragments, "overlap_steps": overlap_steps, "alpha": alpha,
               "pattern": pattern, "outer_lr": float(outer_lr), "outer_momentum": float(outer_momentum),
               "nesterov": nesterov, "compression": None if compression is None else compression.config()}
    # Validate the split before any collective, so a bad F fails alike on every rank without a hang.
    state = _StreamingState(module, comm, sync_every, fragments, overlap_steps, alpha, pattern, outer_lr,
                            outer_momentum, nesterov, None if compression is None else compression.fresh())
    check_agreement(comm, who, {"parameters": describe_parameters(module), "options": options})
    if comm.size > 1:
        with torch.no_grad():
            broadcast_coalesced(comm, [local(p.data) for p in module.parameters()] + [b.data for b in module.buffers()])
            for anchor, p in zip(state.anchors, state.params):
                anchor.copy_(p)  # the anchors were taken before the broadcast
    mix_in(module, StreamingDiLoCoModule, "StreamingDiLoCo")
    module._local_sgd = state
    register_counting(module)  # the inner optimizer's step counts (step_hook.py)
    declare_streaming(module, comm, options)
    log.debug("StreamingDiLoCo over %d ranks: H=%d, %d fragments at steps %s, overlap %d, alpha %g", comm.size,
              sync_every, fragments, [f.offset for f in state.fragments], overlap_steps, alpha)
    return module
