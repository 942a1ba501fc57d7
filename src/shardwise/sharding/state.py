"""Whole-model views of a sharded model: full state dicts (save / load) and the global gradient norm.

`full_state_dict(model)` returns exactly the keys and shapes of the plain model's `state_dict()` (tied weights
appear under each of their names, as PyTorch does), gathering each unit's shards with one all-gather per unit.
`load_full_state_dict(model, sd)` copies each rank's slice out of the full tensors: no communication. Both work for
sharded (ZeRO / FSDP), DDP and plain modules, so a state dict moves freely between strategies and world sizes.

`clip_grad_norm_(model, max_norm)`: each gradient element of a sharded model lives on exactly one rank of its
shard group (replicas of hybrid sharding hold identical copies), so the global squared norm is the sum of local
squared norms all-reduced over the shard group; the infinity norm uses MAX. The result equals the single-process
norm, and every rank scales its shard by the same factor.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..comm.base import ReduceOp

__all__ = ["full_state_dict", "load_full_state_dict", "clip_grad_norm_"]


def _engine(model: nn.Module):  # noqa: ANN202
    return getattr(model, "_sharding", None)


def full_state_dict(model: nn.Module, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The plain `state_dict()` of the unwrapped model: original names, full shapes, master dtype, on CPU.

    Works for sharded (ZeRO / FSDP), DDP, tensor-parallel (gathered over each layer's group) and plain models.
    Collective for sharded models (every rank must call it). With `rank0_only=True` other ranks get {}.
    """
    engine = _engine(model)
    if engine is None:
        # Plain, DDP or tensor-parallel: the tensor-parallel gather leaves whole parameters as they are.
        from ..tensor_parallel import full_state_dict as tensor_parallel_full_state_dict

        return {k: v.cpu() for k, v in tensor_parallel_full_state_dict(model).items()}
    # Gather every unit once, in unit order (the same collective order on every rank).
    full: dict[int, torch.Tensor] = {}
    for unit in engine.units:
        if unit.numel == 0:
            continue
        gathered = torch.empty(unit.padded, dtype=unit.master_dtype, device=unit.master_device)
        unit.shard_comm.all_gather(gathered, unit.master.detach())
        for info in unit.infos:
            full[id(info.shard_param)] = gathered[info.offset : info.offset + info.numel].view(info.shape)
    result: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        for name, p in module._parameters.items():
            if p is not None:
                tensor = full.get(id(p))
                result[dot + name] = (tensor if tensor is not None else p.detach()).cpu().clone()
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                result[dot + name] = b.detach().cpu().clone()
    if rank0_only and engine.shard_comm.rank != 0:
        return {}
    return result


def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> None:
    """Load a plain (full) state dict into a sharded, DDP or plain model. Shapes are checked; errors name the key."""
    engine = _engine(model)
    if engine is None:
        model.load_state_dict(state_dict, strict=strict)
        return
    by_param = {id(info.shard_param): (unit, info) for unit in engine.units for info in unit.infos}
    expected: set[str] = set()
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        for name, p in module._parameters.items():
            if p is None:
                continue
            key = dot + name
            expected.add(key)
            if key not in state_dict:
                continue
            unit, info = by_param[id(p)]
            value = state_dict[key]
            if tuple(value.shape) != tuple(info.shape):
                raise ValueError(f"load_full_state_dict: {key!r} has shape {tuple(value.shape)} in the state dict "
                                 f"but {tuple(info.shape)} in the model")
            unit.load_full_tensor(info, value)
        for name, b in module._buffers.items():
            if b is None or name in module._non_persistent_buffers_set:
                continue
            key = dot + name
            expected.add(key)
            if key in state_dict:
                with torch.no_grad():
                    b.copy_(state_dict[key])
    if strict:
        missing = sorted(expected - state_dict.keys())
        unexpected = sorted(state_dict.keys() - expected)
        if missing or unexpected:
            raise ValueError(f"load_full_state_dict: missing keys {missing[:8]}, unexpected keys {unexpected[:8]}")


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale gradients so their global norm is at most `max_norm`; return the global norm (before clipping)."""
    if not max_norm > 0:
        raise ValueError(f"clip_grad_norm_: max_norm={max_norm!r} must be positive")
    engine = _engine(model)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if engine is None:  # plain or DDP: every rank holds whole (identical) gradients
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    norm_type = float(norm_type)
    device = engine.units[0].master_device
    if math.isinf(norm_type):
        local = torch.stack([g.detach().abs().max() for g in grads if g.numel()]).max() if grads else None
        total = (local if local is not None else torch.zeros((), device=device)).float().reshape(1)
        engine.shard_comm.all_reduce(total, ReduceOp.MAX)
        norm = total[0]
    else:
        local = sum((g.detach().float().norm(norm_type) ** norm_type for g in grads if g.numel()),
                    torch.zeros((), device=device))
        total = local.reshape(1).clone()
        engine.shard_comm.all_reduce(total, ReduceOp.SUM)
        norm = total[0] ** (1.0 / norm_type)
    scale = max_norm / (norm + 1e-6)
    if scale < 1:
        for g in grads:
            g.detach().mul_(scale)
    return norm
