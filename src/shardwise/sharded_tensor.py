"""Sharded parameters that look like the model's: this rank's piece of a tensor, answering for the whole tensor.

Why. Under ZeRO and FSDP each rank's optimizer trains a flat, 1-D piece of every parameter. If the parameters
`model.parameters()` yields said so (`dim() == 1`, `numel()` = the piece), ordinary training scripts would be
silently wrong: weight-decay groups chosen by `p.dim() >= 2` would decay nothing, a parameter count (MFU) would
count one rank's share, and `torch.nn.utils.clip_grad_norm_` would clip each rank by the norm of its own piece.
So the pieces are `ShardedParameter`s (and their gradients `ShardedTensor`s): tensors whose storage is the local
piece, exactly as before (every torch kernel, every optimizer, runs on it unchanged, with no copy), but whose
`shape`, `size()`, `dim()`, `ndim`, `numel()` and `len()` answer for the original tensor, as FSDP2's DTensor
parameters do.

What may be computed on them (`__torch_function__`, Python-level, so one call per operation):
* elementwise operations (aten ops tagged pointwise, `torch._foreach_*` but the maxima, fills, copies, casts): what
  optimizers do, on the local piece; an out-of-place result is sharded again (`p.grad.abs()`), a `zeros_like` or
  `torch._foreach_*` result is plain (an optimizer's state); `view_as_real` / `view_as_complex` give a piece;
* random fills, drawn as one process draws them (sharded_whole.py); writes through a whole index (`w[pad] = 0`:
  sharded_index.py); whole tensors' norms and overflow checks (torch's clip, GradScaler: sharded_norm.py);
* metadata (dtype, device, requires_grad, `.grad`, strides, storage); `.data` is the same piece answering for the
  whole (reading it also calls the piece's `on_data_read` callback);
* anything else (`sum`, `max`, reads through an index, views, `item()`, `torch.save` of the piece): a RuntimeError
  naming the operation and the shardwise way (`sw.full_state_dict`, ...): no wrong number silently. The library's
  own code reads the plain piece through `local(t)`.

Not DTensor: it needs a torch.distributed process group (shardwise's thread and MPI communicators are not) and
splits whole dims into even chunks, while a ZeRO piece is any flat range of a unit's buffer, gathered straight into
views. The cost is one Python `__torch_function__` call per torch operation touching a sharded tensor
(docs/sharding.md has the figure); torch kernels themselves run unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any

import torch
from torch import nn
from torch.optim import optimizer as torch_optimizer
from torch.utils import _foreach_utils as torch_foreach_utils

from .sharded_messages import (CLIP, MESSAGES, PIECE, PIECE_OPTIMIZERS, address_of_piece, broadcast_piece, data_set,
                               part_of_model, pickling, piece_only, whole_with_piece)
from .sharded_data import data_read, on_data_read, watches_data
from .sharded_index import indexes_whole, select_whole, set_whole
from .sharded_norm import ACROSS_RANKS, across_ranks
from .sharded_whole import (RANDOM_FILLS, RANDOM_LIKE, drawn_as_one_process, fits_whole, is_initialiser,
                            this_ranks_part)

__all__ = ["ShardSpec", "ShardedTensor", "ShardedParameter", "local", "as_sharded", "is_sharded", "spec_of",
           "grad_like", "on_data_read"]


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """What a sharded piece answers for. shape: the original tensor's (global) shape. name: its name in the model,
    for messages. what: which strategy holds the piece ("ZeRO-3", ...). whole: the tensor is whole, but part of a
    model spread over ranks (a pipeline stage's gradient): everything runs on it but what combines tensors into one
    model-wide figure (torch's clip and GradScaler, `_ACROSS_RANKS`), which would see only this rank's part. flat:
    the piece is a flat range of the tensor's elements (ZeRO/FSDP), not a sub-tensor in the tensor's own layout (a
    tensor-parallel or expert slice), so nothing may broadcast it. held: the piece's place in the whole tensor,
    `layout.held_views` of its placement (set when a strategy declares it): random fills and whole-shaped operands
    (sharded_whole.py). norm_over: (whether this rank counts the piece once, the groups across which its tensor's
    pieces and copies lie), set with `held`: norms of the whole tensor (sharded_norm.py)."""

    shape: torch.Size
    name: str
    what: str = "ZeRO/FSDP"
    whole: bool = False
    flat: bool = False
    held: Any = dataclasses.field(default=None, compare=False, repr=False)
    norm_over: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


_SPEC = "_sw_spec"
_run_plain = torch._C._disabled_torch_function_impl
_KINDS: dict[Any, str] = {}  # per torch function: "elementwise", "plain", "random", "meta", "refuse"... (see _kind)


class _Sharded:
    """The metadata half shared by ShardedTensor and ShardedParameter (see the module docstring)."""

    @property
    def shape(self) -> torch.Size:  # type: ignore[override]
        return getattr(self, _SPEC).shape

    def size(self, dim: int | None = None) -> Any:  # type: ignore[override]
        shape = getattr(self, _SPEC).shape
        return shape if dim is None else shape[dim]

    def dim(self) -> int:  # type: ignore[override]
        return len(getattr(self, _SPEC).shape)

    ndimension = dim

    @property
    def ndim(self) -> int:  # type: ignore[override]
        return self.dim()

    def numel(self) -> int:  # type: ignore[override]
        return getattr(self, _SPEC).numel

    nelement = numel

    def __len__(self) -> int:
        shape = getattr(self, _SPEC).shape
        if not shape:
            raise TypeError("len() of a 0-d tensor")
        return shape[0]

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        spec = getattr(self, _SPEC)
        return (f"{type(self).__name__}({spec.name}: shape {tuple(spec.shape)}, this rank holds "
                f"{local(self).numel()} of its {spec.numel} elements under {spec.what}; sw.full_state_dict(model) "
                f"has the whole tensor)")

    def __reduce_ex__(self, protocol: Any) -> Any:
        spec = getattr(self, _SPEC)
        if spec.whole:
            return local(self).__reduce_ex__(protocol)
        raise RuntimeError(pickling(spec, local(self).numel()))

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kind = _KINDS.get(func)
        if kind is None:
            kind = _KINDS[func] = _kind(func)
        if kind == "address" and _is_piece(args[0]):
            _refuse_address(args[0])
        if kind == "transpose" and local(args[0]).dim() != len(getattr(args[0], _SPEC).shape):
            _refuse(func, args, kwargs or {})  # Muon's `grad.T`: a tensor-parallel slice, a matrix itself, may
        if kind == "complex_view" and isinstance(args[0], _Sharded):
            return _complex_view(func, args[0])
        if kind in ("random", "random_like") and _is_piece(args[0] if args else (kwargs or {}).get("tensor")):
            return _random(func, kind, args, kwargs or {})  # else as torch runs it: the whole tensor is here
        if kind == "refuse" and func in ACROSS_RANKS:  # torch's clip and GradScaler: whole tensors' figures
            if (out := across_ranks(func, args, kwargs or {}, local, spec_of)) is not None:
                return out
        if kind in ("index", "masked") and isinstance(args[0], _Sharded) and not isinstance(args[-1], _Sharded) \
                and indexes_whole(spec := getattr(args[0], _SPEC), args[1]):  # `w[pad] = 0`, `init.zeros_(w[pad])`
            return (select_whole if kind == "index" else set_whole)(args[0], spec, local(args[0]), *args[1:])
        if kind == "data":
            data_read(args[0])
        elif kind == "data_set" and watches_data(args[0]) and args[1] is not args[0]:
            raise RuntimeError(data_set(getattr(args[0], _SPEC)))  # `p.data = p`: a move that changed nothing
        if kind in ("refuse", "index") or (kind == "masked" and not any(isinstance(a, _Sharded) for a in args[1:2])):
            if not _whole_and_local(func, args, kwargs or {}):
                _refuse(func, args, kwargs or {})
        if kind == "elementwise" and args:
            args = _check_operands(func, args)  # a whole-shaped operand cut to the piece's part, or refused
        # torch's C implementation of "run with __torch_function__ off" (what nn.Parameter uses): the cheapest way.
        out = _run_plain(func, types, args, kwargs) if kwargs else _run_plain(func, types, args)
        if kind == "elementwise" and out is not None and not (args and out is args[0]):
            return _reshard(out, args, kwargs or {})
        if kind == "data" and isinstance(args[0], _Sharded):  # `p.data` is the same piece, answering for the whole
            return as_sharded(out, getattr(args[0], _SPEC))
        return out  # in-place results, metadata, getters and setters, like-factories: as torch gives them


def _random(func: Any, kind: str, args: tuple, kwargs: dict) -> Any:
    """A random fill or `rand*_like` of a piece, drawn as one process draws it (sharded_whole.py)."""
    piece = args[0] if args else kwargs["tensor"]  # torch.nn.init's functions pass it by name
    values = drawn_as_one_process(func, local(piece), getattr(piece, _SPEC), args, kwargs)
    if kind == "random_like":
        return as_sharded(values, getattr(piece, _SPEC))
    with torch.no_grad() if not args else contextlib.nullcontext():  # torch.nn.init's functions run under no_grad
        return _run_plain(torch.Tensor.copy_, (type(piece),), (piece, values))  # bumps the version, as a fill


def _complex_view(func: Any, piece: Any) -> Any:
    """The same view of the local elements, a piece of the viewed tensor (real view: a trailing dim of 2)."""
    spec = getattr(piece, _SPEC)
    out = func(local(piece))
    shape = (*spec.shape, 2) if out.dim() > local(piece).dim() else tuple(spec.shape)[:-1]
    return as_sharded(out, dataclasses.replace(spec, shape=torch.Size(shape)))


def _check_operands(func: Any, args: tuple) -> tuple:
    """The arguments of an elementwise operation of a piece with plain tensors of other shapes: one of the whole
    parameter's shape or broadcasting to it (`p.copy_(pretrained)`, `p.mul_(mask)`) is cut to this rank's part
    (sharded_whole.py). Refused: an in-place operation on such a whole tensor (an EMA kept whole, AveragedModel),
    which would mix this rank's piece into every element; lists of them; any other tensor the flat piece would
    broadcast against (`x * w`, `w` read where its unit is not gathered). torch._foreach_* calls are checked at their
    first index only (the optimizer's moment lists lead its calls: O(1))."""
    piece, others = None, []
    for a in args:
        t = (a[0] if a else None) if isinstance(a, (list, tuple)) else a
        if isinstance(t, _Sharded):
            piece = t if piece is None and not getattr(t, _SPEC).whole else piece
        elif isinstance(t, torch.Tensor) and t.dim():
            others.append(t.shape)
    if piece is None or not others:  # an optimizer's scalars (0-d tensors, numbers): nothing to compare
        return args
    spec, mine = getattr(piece, _SPEC), local(piece).shape
    others = [shape for shape in others if shape != mine]
    if not others:  # the optimizer's state and the gradient: shaped like the piece
        return args
    name = getattr(func, "__name__", str(func))
    whole_target = not isinstance(args[0], _Sharded) and (name.endswith("_") or name.startswith("__i"))
    if (spec.held is not None and not whole_target and all(fits_whole(s, spec) for s in others)
            and not any(isinstance(a, (list, tuple)) for a in args)):
        cut = [isinstance(a, torch.Tensor) and not isinstance(a, _Sharded) and a.dim() > 0 and a.shape != mine
               for a in args]
        return tuple(this_ranks_part(a, spec, local(piece)) if c else a for a, c in zip(args, cut))
    if spec.shape in others:
        raise RuntimeError(whole_with_piece(name, spec, local(piece).numel()))
    if spec.flat and any(_broadcasts(shape, mine) for shape in others):
        raise RuntimeError(broadcast_piece(name, spec, local(piece).numel(), next(s for s in others)))
    return args


def _broadcasts(shape: torch.Size, mine: torch.Size) -> bool:
    try:
        return torch.broadcast_shapes(shape, mine) != mine
    except RuntimeError:  # no common shape (an empty piece): torch's own message would name neither tensor
        return True


def _is_piece(t: Any) -> bool:
    spec = getattr(t, _SPEC, None)
    return spec is not None and not spec.whole and local(t).numel() != spec.numel


def _refuse_address(t: Any) -> None:
    """`data_ptr()` of a piece answering for a larger tensor: what reads `numel()` elements from that address
    (safetensors' save_file, numpy through ctypes) would copy past the piece's end. Its own code reads `local(t)`."""
    raise RuntimeError(address_of_piece(getattr(t, _SPEC), local(t).numel()))


class ShardedTensor(_Sharded, torch.Tensor):
    """A sharded piece that is not a parameter: a gradient, or an elementwise result of a sharded tensor."""


class ShardedParameter(_Sharded, nn.Parameter):
    """What `model.parameters()` yields under ZeRO / FSDP: this rank's piece, answering for the whole parameter."""


# An optimizer picks its multi-tensor (foreach) or fused implementation by default only for the tensor types listed
# here (torch.optim.optimizer._default_to_fused_or_foreach), as DTensor registers itself: without this a sharded
# model's AdamW on CUDA would loop over its tensors one by one (a few kernels per tensor instead of a few in all).
for _types in (getattr(torch_optimizer, "_foreach_supported_types", []),
               getattr(torch_foreach_utils, "_foreach_supported_types", [])):
    _types.extend(cls for cls in (ShardedTensor, ShardedParameter) if cls not in _types)


def as_sharded(piece: torch.Tensor, spec: ShardSpec, parameter: bool = False, requires_grad: bool = False) -> Any:
    """`piece` (its storage, no copy) as a ShardedParameter / ShardedTensor answering for `spec`."""
    piece = local(piece)
    out = torch.Tensor._make_subclass(ShardedParameter if parameter else ShardedTensor, piece.detach(), requires_grad)
    setattr(out, _SPEC, spec)
    return out


def set_spec(t: torch.Tensor, spec: ShardSpec) -> None:
    """Re-describe a sharded tensor (a strategy learns the original name and shape after making the piece)."""
    setattr(t, _SPEC, spec)


def is_sharded(t: Any) -> bool:
    return isinstance(t, _Sharded)


def spec_of(t: torch.Tensor) -> ShardSpec | None:
    return getattr(t, _SPEC, None) if isinstance(t, _Sharded) else None


def grad_like(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`grad` (a plain tensor shaped like `param`'s piece) as `param`'s gradient: a ShardedTensor answering for the
    whole when `param` is a sharded piece, `grad` itself otherwise. No copy."""
    spec = spec_of(param)
    return grad if spec is None else as_sharded(grad, spec)


def local(t: Any) -> Any:
    """The plain tensor of this rank's piece (a view of the same storage; no copy), or `t` itself when not sharded."""
    if isinstance(t, _Sharded):
        with torch._C.DisableTorchFunctionSubclass():
            return torch.Tensor.as_subclass(t, torch.Tensor)
    return t


# ---- which operations run on the piece -------------------------------------------------------------------------
_IDENTITY = frozenset({
    "detach", "detach_", "clone", "contiguous", "conj", "conj_physical", "resolve_conj", "resolve_neg", "to", "cpu",
    "cuda", "float", "double", "half", "bfloat16", "type_as", "_to_copy", "copy_", "zero_", "fill_", "requires_grad_",
    "masked_fill_", "lerp_", "div_", "mul_", "add_", "sub_", "clamp_min_", "clamp_max_", "sign_", "pow_",
})
# torch's fused optimizer steps (`fused=True`, nanoGPT's default on CUDA): one kernel updating every element from
# its own gradient and state; the loss-scale arguments (`grad_scale`, `found_inf`) are plain scalars.
_FUSED_OPTIMIZERS = frozenset({"_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_"})
_PLAIN = frozenset({"zeros_like", "ones_like", "empty_like", "full_like"})
_META = frozenset({
    "__get__", "__set__", "__delete__", "element_size", "untyped_storage", "storage_offset", "stride",
    "is_contiguous", "is_floating_point", "is_complex", "is_signed", "get_device", "dim_order", "is_pinned",
    "pin_memory", "share_memory_", "is_shared", "register_hook", "register_post_accumulate_grad_hook", "retain_grad",
    "_is_view", "is_set_to", "_version", "__hash__", "__eq_id__", "__deepcopy__", "__setstate__", "is_nonzero_free",
    "record_stream", "backward", "__format__", "_backward_hooks", "grad_fn", "_has_compatible_shallow_copy_type",
    "is_inference", "is_neg", "is_conj", "_is_zerotensor", "has_names", "is_meta", "is_cuda", "is_cpu",
})


@functools.lru_cache(maxsize=None)
def _kind_of_name(name: str) -> str:
    if name == "data_ptr":  # metadata, but of the piece: refused where the piece is not the whole (`_is_piece`)
        return "address"
    if name in _META:  # getters and setters (`__get__`, `__set__`) included
        return "meta"
    if name in _PLAIN:
        return "plain"
    if name in RANDOM_FILLS or name in RANDOM_LIKE:
        return "random" if name in RANDOM_FILLS else "random_like"
    if name in _IDENTITY:
        return "elementwise"
    if name.startswith("_foreach_"):
        return "refuse" if name in ("_foreach_norm", "_foreach_max") else "elementwise"
    if name in _FUSED_OPTIMIZERS:
        return "elementwise"
    if name.startswith("__") and name.endswith("__"):
        inner = name[2:-2]
        if inner.startswith("i") and hasattr(torch.ops.aten, inner[1:] + "_"):
            name = inner[1:] + "_"
        elif inner.startswith("r") and hasattr(torch.ops.aten, inner[1:]):
            name = inner[1:]
        else:
            name = inner
    packet = getattr(torch.ops.aten, name, None)
    if packet is None or not hasattr(packet, "overloads"):
        return "refuse"
    tags = {tag for overload in packet.overloads() for tag in getattr(packet, overload).tags}
    if torch.Tag.pointwise in tags and torch.Tag.reduction not in tags:
        return "elementwise"
    return "refuse"


_TRANSPOSES = (torch.Tensor.T, torch.Tensor.mT, torch.Tensor.H, torch.Tensor.mH)


def _kind(func: Any) -> str:
    owner = getattr(func, "__self__", None)
    if owner is torch.Tensor.data:  # the getter and setter of `.data`
        return "data" if func.__name__ == "__get__" else "data_set"
    if any(owner is t for t in _TRANSPOSES):  # a transposed view: of a flat ZeRO piece, not of the matrix
        return "transpose"
    name = getattr(func, "__name__", "")
    if is_initialiser(func):  # torch.nn.init's functions that dispatch (or a library's stand-ins): a whole fill
        return "random"
    if name in ("view_as_real", "view_as_complex"):
        return "complex_view"
    if name == "__setitem__":  # elementwise when the index is a mask made from a piece (Rprop: grad[sign < 0] = 0)
        return "masked"
    if name == "__getitem__":  # an index of the whole tensor (sharded_index.py)
        return "index"
    return _kind_of_name(name)


def _first_sharded(args: Any, kwargs: dict) -> Any:
    """The first sharded tensor among the arguments (lists of tensors included), or None."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, _Sharded):
            return a
        if isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, _Sharded):
                    return b
    return None


def _reshard(out: Any, args: tuple, kwargs: dict) -> Any:
    """The result of an out-of-place elementwise operation is a piece of the same tensor: sharded again."""
    if isinstance(out, torch.Tensor) and not isinstance(out, _Sharded):
        source = _first_sharded(args, kwargs)
        return as_sharded(out, getattr(source, _SPEC), requires_grad=out.requires_grad) if source is not None else out
    return out  # lists (torch._foreach_* results) stay plain: wrapping each costs more (bench/sharded_params.py)


# What torch's clip_grad_norm_ (foreach or per tensor) and GradScaler's unscale_ run: on a whole tensor that is part
# of a model spread over ranks they would produce this rank's figure where the model's is meant.
_ACROSS_RANKS = frozenset({"_foreach_norm", "linalg_vector_norm", "_amp_foreach_non_finite_check_and_unscale_"})


def _whole_and_local(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether an otherwise refused operation may run: on whole tensors, anything but `_ACROSS_RANKS`."""
    source = _first_sharded(args, kwargs)
    return source is not None and getattr(source, _SPEC).whole and getattr(func, "__name__", "") not in _ACROSS_RANKS


def _refuse(func: Any, args: tuple, kwargs: dict) -> None:
    name = getattr(func, "__name__", str(func))
    if name in ("__get__", "__set__"):  # a property: its own name (`.T`)
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    source = _first_sharded(args, kwargs)
    spec, piece = getattr(source, _SPEC), local(source).numel()
    if spec.whole:
        raise RuntimeError(part_of_model(name, spec, MESSAGES.get(name, CLIP)))
    raise RuntimeError(piece_only(name, spec, piece, MESSAGES.get(name, PIECE) + PIECE_OPTIMIZERS))
