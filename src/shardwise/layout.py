"""The layout contract: what each strategy did to a model, declared by the strategy and read by whole-model tools.

Whole-model tools (full state dicts, clipping, the grad scaler, memory statistics, checkpoints, the planner) never
probe a strategy's private attributes. Each strategy declares instead, when it wraps a model:

* a :class:`Placement` per parameter: its original name(s), global shape, the tensor this rank trains, the
  *boxes* of the global tensor this rank's tensor-parallel slice covers, the *flat range* of that slice this rank
  keeps (ZeRO / FSDP), and the groups over which the parameter is sharded and over which it is replicated;
* a :class:`Parallelized` record (its name, its communicators, the placements after it, `no_sync`, what it holds
  in memory), appended to the model's list, innermost first, and reachable only through :func:`strategies`.

Geometry (the box helpers live in boxes.py). A *box* is ``((start, size), ...)`` per dim of the global tensor. A
tensor-parallel rank's local slice is its boxes concatenated along `concat_dim` (one box for a plain row/column
split; k boxes for a column split of k fused blocks such as ``[q | k | v]``), stored permuted by `stored_perm` when
the layer keeps the transpose (a HuggingFace Conv1D held as an nn.Linear). ZeRO then keeps the flat range ``[lo,
hi)`` of the stored slice's flattening. :func:`held_views` turns all that back into (global box, view of the local
tensor) pairs: the flat range is cut into at most ``2 x ndim - 1`` contiguous boxes (a partial first row, whole
rows, a partial last row, recursively), each un-permuted and split at the block boundaries. A checkpoint piece or a
state-dict slice is therefore always a plain N-d box of the global tensor, and any layout reloads onto any other
(the idea of PyTorch DCP's chunk metadata and Megatron's ``sharded_state_dict``, without DTensor).

Counting once. A rank counts a parameter in a global sum (the gradient norm) only if it is rank 0 of every group
holding copies of it; the partial sums are then summed over every group of the model (:func:`reduction_groups`).

Anchors: Megatron-core's tensor-parallel parameter attributes and ``sharded_state_dict``; DTensor placements.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .boxes import Box, box_numel, box_slices, full_box, intersect, inverse_perm, split_flat_range
from .comm.base import Communicator
from .sharded_tensor import local, set_spec, spec_of

__all__ = ["Box", "Placement", "Parallelized", "MemoryView", "ExtraState", "extra_states", "strategies", "placements",
           "declare", "base_placements", "held_views", "slice_views", "inverse_perm", "split_flat_range", "box_slices",
           "box_numel", "intersect", "full_box", "reduction_groups", "counts_here", "record_comms", "is_partitioned",
           "merged_memory", "model_world", "is_wrapped", "check_not_data_parallel", "DATA_PARALLEL", "buffers",
           "hand_over"]

_ATTR = "_shardwise_layout"  # the one attribute a wrapped model carries; read only by this module
_TRAINED_BY = "_shardwise_trained_by"  # a model given to sw.parallelize: the HybridModel training its layers


@dataclasses.dataclass(frozen=True, eq=False)
class Placement:
    """Where one parameter of the original model lives on this rank (see the module docstring).

    names: its names in the original model (a tied parameter has several; the first is canonical).
    shape: the global (original) shape. param: the tensor this rank trains (what the optimizer sees); under ZeRO /
        FSDP a `sharded_tensor.ShardedParameter` answering for the whole tensor: tools read its piece through
        `sharded_tensor.local(param)` (held_views does).
    boxes: this rank's tensor-parallel boxes (None: the whole tensor); box_group: the group across which boxes differ,
        boxes_by_rank: every rank of box_group's boxes, in group-rank order (to gather the whole tensor).
    concat_dim: the dim along which the boxes are concatenated into the local slice (their other sizes agree).
    stored_perm: the local slice is stored as ``slice.permute(stored_perm)`` (None: as it is).
    flat: [lo, hi) of the local (boxes') flattening held in `param`, a 1-D tensor (None: all of it);
        flat_group / flat_by_rank: the group across which flat ranges differ, and every rank's range.
    replicated_over: groups whose ranks hold identical copies of this rank's piece.
    partial_grad_over: a group over which the parameter's gradient is a partial sum that a hook completes
        (sequence parallel: replicated weights applied to sequence shards).
    tied_over: a group of ranks each holding a copy of this parameter used by a different pipeline stage (a GPT's
        embedding and head); the pipeline sums the copies' gradients over it, so a data-parallel strategy must keep
        the parameter whole (the sharding engine does, as a replicated parameter) and counts it once.
    """

    names: tuple[str, ...]
    shape: tuple[int, ...]
    param: nn.Parameter
    boxes: tuple[Box, ...] | None = None
    box_group: Communicator | None = None
    boxes_by_rank: tuple[tuple[Box, ...], ...] = ()
    concat_dim: int = 0
    stored_perm: tuple[int, ...] | None = None
    flat: tuple[int, int] | None = None
    flat_group: Communicator | None = None
    flat_by_rank: tuple[tuple[int, int], ...] = ()
    replicated_over: tuple[Communicator, ...] = ()
    partial_grad_over: Communicator | None = None
    tied_over: Communicator | None = None

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def local_boxes(self) -> tuple[Box, ...]:
        return self.boxes if self.boxes is not None else (full_box(self.shape),)

    def slice_shape(self, boxes: tuple[Box, ...] | None = None) -> tuple[int, ...]:
        """Shape of the local slice made of `boxes` (this rank's by default), before `stored_perm`."""
        boxes = boxes if boxes is not None else self.local_boxes
        if not self.shape:
            return ()
        shape = [n for _, n in boxes[0]]
        shape[self.concat_dim] = sum(b[self.concat_dim][1] for b in boxes)
        return tuple(shape)

    def stored_shape(self, boxes: tuple[Box, ...] | None = None) -> tuple[int, ...]:
        shape = self.slice_shape(boxes)
        return shape if self.stored_perm is None else tuple(shape[i] for i in self.stored_perm)

    @property
    def local_numel(self) -> int:
        """Elements of the tensor-parallel slice (before ZeRO's flat range)."""
        return sum(box_numel(b) for b in self.local_boxes)

    @property
    def flat_range(self) -> tuple[int, int]:
        return self.flat if self.flat is not None else (0, self.local_numel)

    @property
    def sharded_over(self) -> tuple[Communicator, ...]:
        return tuple(g for g in (self.box_group, self.flat_group) if g is not None and g.size > 1)


@dataclasses.dataclass(frozen=True)
class MemoryView:
    """Tensors a strategy holds beyond the placements' parameters and their .grad: flat buffers, master copies."""

    params: tuple[torch.Tensor, ...] = ()
    grads: tuple[torch.Tensor, ...] = ()
    gathered_peak: int = 0
    gathered_now: int = 0
    grad_buffer_peak: int = 0
    # CPU offload: tensors held in host memory, and the parameters whose gradient and optimizer state live there.
    host: tuple[torch.Tensor, ...] = ()
    host_params: tuple[torch.Tensor, ...] = ()


@dataclasses.dataclass(frozen=True, eq=False)
class ExtraState:
    """State a strategy keeps besides parameters, buffers and optimizer state, which a checkpoint saves and restores
    with the model (docs/checkpoints.md, "Strategy state"): compressors' residuals, local SGD's anchors.
    name: unique among the model's extra states ("compressor", "local_sgd"): the checkpoint's key for it.
    scope: "per_rank", each rank's own (residuals): saved by every rank, reloaded only onto the same world size and
        rank layout; or "replicated", equal on every rank of the model: saved once, reloaded on any world size.
    state_dict: () -> {key: tensor or JSON value}, flat, this rank's state; the tensors are copied when saved.
    load_state_dict: (such a dict) -> None, installing it; for per_rank state, {} resets it to a fresh start.
    check: (such a dict) -> None, raising ValueError naming what does not fit, without changing anything; a load
        calls it on every rank before any rank commits (None: every dict `state_dict` could return fits).
    config: JSON-able options the state is only valid under (the compressor's configuration, the bucket sizes):
        a load refuses state saved under other ones. group: the ranks the state is per rank in (its collectives').
    """

    name: str
    scope: str
    state_dict: Callable[[], dict[str, Any]]
    load_state_dict: Callable[[dict[str, Any]], None]
    check: Callable[[dict[str, Any]], None] | None = None
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    group: Communicator | None = None

    def __post_init__(self) -> None:
        if self.scope not in ("per_rank", "replicated"):
            raise ValueError(f"ExtraState {self.name!r}: scope={self.scope!r}; allowed: 'per_rank', 'replicated'")


@dataclasses.dataclass(eq=False)
class Parallelized:
    """One applied strategy. name: "ddp", "zero3", "fsdp:hybrid_shard", "tensor_parallel", "pipeline", ...

    comms: the groups it communicates over (clipping and overflow flags reduce over these, innermost first).
    placements: every parameter's placement after this strategy, by canonical name, in model order.
    Both may be functions, evaluated when asked (a container whose parts are wrapped later stays current).
    no_sync: a context manager factory skipping its gradient reduction (None: it has none).
    memory: what it holds beyond the parameters (flat buffers, master shards), for memory_stats.
    world: a communicator spanning every rank of the model when the strategy knows one (a Mesh's world).
    partitioned_over: a group across which ranks hold *different parameters* (pipeline stages).
    options: what the strategy was asked for, for describe() / the planner (JSON-able values).
    extra_state: state it holds besides parameters and optimizer, for checkpoints (see ExtraState); may be a
        function, evaluated when asked (a pipeline gathers its stages' states, declared when the stages are wrapped).
    before_step: run by the optimizer guard before a step over some of its parameters (ids): DDP's averaged-grad check.
    """

    name: str
    comms: tuple[Communicator, ...] | Callable[[], tuple[Communicator, ...]]
    placements: dict[str, Placement] | Callable[[], dict[str, Placement]]
    no_sync: Callable[[], Any] | None = None
    memory: Callable[[], MemoryView] | None = None
    world: Communicator | None = None
    partitioned_over: Communicator | None = None
    buffer_names: dict[str, str] | None = None  # local buffer name -> original name (pipeline stages)
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    extra_state: tuple[ExtraState, ...] | Callable[[], tuple[ExtraState, ...]] = ()
    before_step: Callable[[set[int]], None] | None = None


def _inner(model: nn.Module) -> nn.Module:
    """The module, or the one torch.compile wrapped (OptimizedModule._orig_mod, whose layout tools see), or the one it
    was handed over to (`hand_over`); TypeError
    for what is not a module (torch's habit `clip_grad_norm_(model.parameters(), ...)`)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected the model (a torch.nn.Module, as the wrapper returned it), got "
                        f"{type(model).__name__}: pass the model itself, e.g. sw.clip_grad_norm_(model, max_norm)")
    model = model._orig_mod if type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod") else model
    return model.__dict__.get(_TRAINED_BY, model)


def hand_over(model: nn.Module, trained_by: nn.Module) -> None:
    """From now on the tools given `model` ask `trained_by`'s layout: the module that trains `model`'s parameters in
    its place (sw.parallelize's HybridModel, whose stages hold the layers, some on other ranks, some as pieces), so
    `sw.full_state_dict(model)` and the others answer for the model as trained, not for its stale copy here."""
    model.__dict__[_TRAINED_BY] = trained_by


def strategies(model: nn.Module) -> list[Parallelized]:
    """The strategies applied to `model`, innermost (first applied) first; [] for a plain module."""
    return list(_inner(model).__dict__.get(_ATTR, ()))


def extra_states(model: nn.Module) -> dict[str, ExtraState]:
    """Every strategy's extra state (see ExtraState), by name, innermost strategy first; ValueError on a clash."""
    out: dict[str, ExtraState] = {}
    for record in strategies(model):
        for state in _evaluate(record.extra_state):
            if state.name in out:
                raise ValueError(f"two strategies of the model declare extra state named {state.name!r} "
                                 f"({' + '.join(r.name for r in strategies(model))}); names must be unique")
            out[state.name] = state
    return out


def is_wrapped(model: nn.Module, *names: str) -> bool:
    """Whether a strategy (one of `names`, or any when none are given) has been applied to `model`."""
    return any(not names or s.name.split(":")[0] in names for s in strategies(model))


DATA_PARALLEL = ("ddp", "zero1", "zero2", "zero3", "fsdp")


def check_not_data_parallel(model: nn.Module, who: str) -> None:
    """Refuse to wrap a model a second time with a data-parallel strategy (DDP, ZeRO or FSDP): ValueError."""
    if is_wrapped(model, *DATA_PARALLEL):
        applied = " + ".join(s.name for s in strategies(model))
        raise ValueError(f"{who}: the module is already wrapped by a data-parallel strategy ({applied}); wrap the "
                         f"plain (or tensor-parallel) module once")


def is_partitioned(model: nn.Module) -> bool:
    """Whether this rank holds only part of the model's parameters (a pipeline stage of a pipeline over >1 rank)."""
    return any(r.partitioned_over is not None and r.partitioned_over.size > 1 for r in strategies(model))


def declare(model: nn.Module, record: Parallelized) -> None:
    """Append `record` to `model`'s strategies (a strategy calls it once it has wrapped the model), and tell each
    piece it places where it lies in its whole tensor (`ShardSpec.held`: random fills; `norm_over`: norms)."""
    model.__dict__[_ATTR] = (*model.__dict__.get(_ATTR, ()), record)
    for pl in record.placements.values() if isinstance(record.placements, dict) else ():
        if (spec := spec_of(pl.param)) is not None and not spec.whole:
            over = [pl.flat_group, pl.box_group, *pl.replicated_over, pl.tied_over]
            set_spec(pl.param, dataclasses.replace(spec, held=functools.partial(held_views, pl), norm_over=(
                counts_here(pl), tuple(g for g in over if g is not None and g.size > 1))))


def base_placements(model: nn.Module) -> dict[str, Placement]:
    """One placement per unique parameter of a plain module: whole tensors, nothing sharded or replicated."""
    names: dict[int, list[str]] = {}
    objects: dict[int, nn.Parameter] = {}
    for name, p in _inner(model).named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        objects[id(p)] = p
    return {ns[0]: Placement(tuple(ns), tuple(objects[pid].shape), objects[pid]) for pid, ns in names.items()}


def placements(model: nn.Module) -> dict[str, Placement]:
    """The placements of the outermost strategy (or of the plain module), by canonical name."""
    records = strategies(model)
    return dict(_evaluate(records[-1].placements)) if records else base_placements(model)


def record_comms(record: Parallelized) -> tuple[Communicator, ...]:
    return tuple(_evaluate(record.comms))


def _evaluate(value: Any) -> Any:
    return value() if callable(value) else value


def buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Persistent buffers by their original names (strategies that rename modules declare the mapping)."""
    rename = {old: new for record in strategies(model) for old, new in (record.buffer_names or {}).items()}
    out = {}
    for prefix, module in _inner(model).named_modules():
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                key = f"{prefix}.{name}" if prefix else name
                out[rename.get(key, key)] = b
    return out


def slice_views(pl: Placement, stored: torch.Tensor, boxes: tuple[Box, ...] | None = None,
                origin: tuple[int, ...] | None = None) -> list[tuple[Box, torch.Tensor]]:
    """(global box, view) for each of `boxes` in a slice tensor `stored` (stored layout, shaped per `boxes`), or in
    the sub-box of the slice starting at `origin` (slice coordinates) that `stored` covers."""
    boxes = boxes if boxes is not None else pl.local_boxes
    stored = local(stored)
    if not pl.shape:
        return [((), stored.reshape(()))]
    view = stored if pl.stored_perm is None else stored.permute(inverse_perm(pl.stored_perm))
    origin = origin if origin is not None else (0,) * view.dim()
    d, out, start = pl.concat_dim, [], 0
    for box in boxes:
        size = box[d][1]
        lo, hi = max(start, origin[d]), min(start + size, origin[d] + view.shape[d])
        if lo < hi:
            index = [slice(None)] * view.dim()
            index[d] = slice(lo - origin[d], hi - origin[d])
            glob = [(s + o, n) for (s, _), o, n in zip(box, origin, view.shape)]
            glob[d] = (box[d][0] + lo - start, hi - lo)
            out.append((tuple(glob), view[tuple(index)]))
        start += size
    return out


def merged_memory(modules: Any) -> MemoryView:
    """What the strategies of several modules (pipeline stages) hold, together."""
    views = [r.memory() for m in modules for r in strategies(m) if r.memory is not None]
    return MemoryView(params=tuple(t for v in views for t in v.params), grads=tuple(t for v in views for t in v.grads),
                      gathered_peak=sum(v.gathered_peak for v in views), gathered_now=sum(v.gathered_now for v in views),
                      grad_buffer_peak=sum(v.grad_buffer_peak for v in views))


def held_views(pl: Placement, tensor: torch.Tensor) -> list[tuple[Box, torch.Tensor]]:
    """(global box, writable view of `tensor`) for every element this rank holds; `tensor` is shaped like pl.param
    (the parameter itself, its gradient, or optimizer state that follows it)."""
    tensor = local(tensor)  # a sharded piece's own storage (sharded_tensor.py)
    lo, hi = pl.flat_range
    if pl.flat is None or (lo, hi) == (0, pl.local_numel):
        return slice_views(pl, tensor.view(pl.stored_shape()))
    flat = tensor.view(-1)
    stored = pl.stored_shape()
    perm = pl.stored_perm or tuple(range(len(stored)))
    out, offset = [], 0
    for sub in split_flat_range(full_box(stored), lo, hi):
        n = box_numel(sub)
        piece = flat[offset : offset + n].view([m for _, m in sub])
        origin = tuple(sub[inverse_perm(perm)[j]][0] for j in range(len(sub)))  # the sub-box's corner, slice coordinates
        out += slice_views(pl, piece, origin=origin)
        offset += n
    return out


def counts_here(placement: Placement) -> bool:
    """Whether this rank contributes `placement` to a global sum: rank 0 of every group replicating it (and of the
    ranks holding tied copies)."""
    tied = () if placement.tied_over is None else (placement.tied_over,)
    return all(g.rank == 0 for g in (*placement.replicated_over, *tied))


def reduction_groups(model: nn.Module) -> list[Communicator]:
    """Every group any strategy of `model` communicates over, innermost first, each once: reducing a partial
    result over all of them in this order reduces it over every rank of the model (the same order on all ranks)."""
    seen: list[Communicator] = []
    members: set[tuple[int, ...]] = set()
    for record in strategies(model):
        for comm in (*record_comms(record), record.partitioned_over):
            # Equal groups made by separate splits (each pipeline stage wrapped on its own) reduce once.
            if comm is not None and comm.size > 1 and tuple(comm.global_ranks) not in members:
                members.add(tuple(comm.global_ranks))
                seen.append(comm)
    return seen


def model_world(model: nn.Module, what: str) -> Communicator:
    """The communicator spanning every rank of `model`, or a ValueError saying to pass one (`what` names the caller).

    A strategy's `world` counts when its size is the number of ranks the model spans (the product of its groups'
    sizes: the strategies form a grid): DDP over the whole world does, DDP over the dp axis of a TP model does not,
    a Mesh's world does. A plain model is a world of one.
    """
    groups = reduction_groups(model)
    ranks = math.prod(g.size for g in groups)
    for record in reversed(strategies(model)):
        if record.world is not None and record.world.size == ranks:
            return record.world
    if ranks == 1:
        from .comm.thread_backend import ThreadWorld

        return ThreadWorld(1).communicators()[0]
    names = " + ".join(r.name for r in strategies(model))
    raise ValueError(f"{what}: the model spans {ranks} ranks over {len(groups)} groups ({names}) and none of its "
                     f"strategies knows the communicator of all of them; pass comm= (e.g. mesh.world)")

