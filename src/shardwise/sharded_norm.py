"""torch's clip and GradScaler over sharded gradients: a piece's norm is its whole tensor's, an overflow is everyone's.

`torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)` (and `get_total_norm`) takes one norm per gradient,
`torch._foreach_norm` (or `torch.linalg.vector_norm` per tensor), combines them into the total and scales every
gradient by ``min(max_norm / (total + 1e-6), 1)``. Under ZeRO / FSDP / tensor or expert parallel a gradient is this
rank's piece: taken as it is, each rank would clip by the norm of its own pieces, and the replicas would step apart,
silently. So a norm of a piece is the norm of its whole tensor, as FSDP2's DTensor gradients give it (their norm is
a partial sum that `clip_grad_norm_` all-reduces):

* each rank takes ``sum |x|^p`` over its piece (for p = inf, the max), counted only where the piece is counted once
  (`layout.counts_here`: rank 0 of every group holding copies of it),
* these partial sums are all-reduced over the groups across which the tensor's pieces and copies lie
  (`ShardSpec.norm_over`, set by `layout.declare`: the flat-range group, the tensor-parallel box group, the
  replica groups), one all-reduce per group for all tensors of a call that share those groups,
* and the p-th root, in the dtype torch would return, is each tensor's norm, the same on every rank.

The partial sums accumulate in float64 (one process's norm in float32 or float64 is met to its rounding). Every rank
computes the same norms, so the scaling that follows (`_foreach_mul_` of the pieces, elementwise) is one process's.
These are collectives: every rank of the model must take the norm together (as every rank calls clip_grad_norm_ in a
training loop). Refused (None to the caller, which raises naming `sw.clip_grad_norm_`): a pipeline stage's gradients
(whole tensors of a model spread over stages: the total needs the other stages' tensors), a piece whose place no
strategy declared, norms along dims, orders other than p > 0 and inf, and a norm autograd would differentiate (of a
parameter with grad enabled: a regulariser is computed where the parameter is whole, in a forward hook).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from .comm.base import ReduceOp
from .placement import comm_device

__all__ = ["ACROSS_RANKS", "across_ranks", "whole_norms"]

_UNSCALE = torch._amp_foreach_non_finite_check_and_unscale_
#: what torch's clip_grad_norm_ takes each gradient's norm with, and what GradScaler.unscale_ checks gradients with
ACROSS_RANKS = (torch._foreach_norm, torch.linalg.vector_norm, _UNSCALE)


def across_ranks(func: Any, args: tuple, kwargs: dict, local: Callable, spec_of: Callable) -> Any:
    """torch's whole-model figures over pieces: norms (`whole_norms`) or GradScaler's overflow check
    (`found_inf_everywhere`); None when they cannot be had here (the caller refuses)."""
    if func is _UNSCALE:
        return found_inf_everywhere(args, kwargs, local, spec_of)
    return whole_norms(func, args, kwargs, local, spec_of)


def found_inf_everywhere(args: tuple, kwargs: dict, local: Callable, spec_of: Callable) -> Any:
    """``torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)`` over pieces: each rank unscales
    its pieces and flags an inf or nan in them, and the flag is all-reduced (max) over every group the tensors' pieces
    and copies lie across, so every rank skips the step together when any piece of any gradient overflowed, as one
    process's GradScaler does. Returns the flag (torch returns nothing; the caller ignores it)."""
    grads = list(args[0]) if args else list(kwargs["self"])
    found_inf, inv_scale = (args[1], args[2]) if len(args) > 2 else (kwargs["found_inf"], kwargs["inv_scale"])
    specs = [spec_of(t) for t in grads]
    if any(spec is not None and (spec.whole or spec.norm_over is None) for spec in specs):
        return None
    _UNSCALE([local(t) for t in grads], found_inf, inv_scale)
    seen: dict[int, Any] = {}
    for spec in specs:
        for group in () if spec is None else spec.norm_over[1]:
            seen.setdefault(id(group), group)
    for group in seen.values():
        flag = found_inf.to(comm_device(group))
        group.all_reduce(flag, ReduceOp.MAX)
        found_inf.copy_(flag)
    return found_inf


def _order(args: tuple, kwargs: dict) -> float | None:
    order = args[1] if len(args) > 1 else kwargs.get("ord", kwargs.get("p", 2))
    order = float(order) if isinstance(order, (int, float)) and not isinstance(order, bool) else None
    return order if order is not None and order > 0 else None


def whole_norms(func: Any, args: tuple, kwargs: dict, local: Callable, spec_of: Callable) -> Any:
    """The whole tensors' norms for ``torch._foreach_norm(tensors, ord, dtype=)`` (a list) or
    ``torch.linalg.vector_norm(tensor, ord, dtype=)`` (one tensor); `local` and `spec_of` give each tensor's plain
    storage and ShardSpec (None for a plain tensor). None when it cannot be computed here (module docstring)."""
    order = _order(args, kwargs)
    foreach = func is torch._foreach_norm
    tensors = list(args[0]) if foreach else [args[0]]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None  # a norm to differentiate (a regulariser): computed here it would have no gradient
    pieces = [(local(t), spec_of(t)) for t in tensors]
    dtype = kwargs.get("dtype") or (args[2] if foreach and len(args) > 2 else None)
    along = kwargs.get("dim") is not None or kwargs.get("keepdim") or (not foreach and any(
        a is not None and a is not False for a in args[2:]))
    if order is None or along or any(spec is not None and (spec.whole or spec.norm_over is None)
                                     for _, spec in pieces):
        return None
    infinite = math.isinf(order)
    out: list[torch.Tensor | None] = [None] * len(pieces)
    batches: dict[tuple[int, ...], tuple[tuple, list[int], list[torch.Tensor]]] = {}
    for i, (t, spec) in enumerate(pieces):
        if spec is None:  # a whole tensor: torch's own norm, as one process takes it
            out[i] = torch.linalg.vector_norm(t, order, dtype=dtype)
            continue
        x = t.detach().to(torch.float64).abs()
        value = (x.max() if x.numel() else x.new_zeros(())) if infinite else x.pow(order).sum()
        counted, groups = spec.norm_over
        batch = batches.setdefault(tuple(id(g) for g in groups), (groups, [], []))
        batch[1].append(i)
        batch[2].append(value if counted or infinite else torch.zeros_like(value))
    for groups, members, values in batches.values():
        vector = torch.stack(values)
        for group in groups:
            vector = vector.to(comm_device(group))
            group.all_reduce(vector, ReduceOp.MAX if infinite else ReduceOp.SUM)
        for i, value in zip(members, vector):
            t = pieces[i][0]
            out[i] = (value if infinite else value ** (1.0 / order)).to(device=t.device, dtype=dtype or t.dtype)
    return out if foreach else out[0]
