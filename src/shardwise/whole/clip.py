"""Global gradient-norm clipping for a model under any strategies (Pascanu et al. 2013, "On the difficulty of
training recurrent neural networks").

The norm must be the single-process model's: each gradient element counted exactly once. A rank adds the norm of
each gradient piece it holds only when it is rank 0 of every group that piece is replicated over (DDP replicas,
tensor-parallel LayerNorms, hybrid-shard replicas); pieces of a sharded parameter (ZeRO flat ranges, TP boxes)
are disjoint, so their p-th powers add. The partial sums are then all-reduced over every group of the model's
strategies (`layout.reduction_groups`), which spans all ranks: every rank gets the same norm and scales its
gradients by the same factor, so replicas stay identical. Megatron-core's clip_grad_norm counts replicated
parameters once the same way (its "is not a tensor-parallel duplicate" filter).

Dtypes. Each gradient's norm is taken in float32, or in float64 when any gradient is float64 (a float64 model's
norm then equals torch's to float64 precision); half-precision gradients are widened, as torch's foreach norm
accumulates them in float32. The norm is returned in that dtype.

Kernels and the host. As torch's own clip_grad_norm_: the pieces' norms are one `_foreach_norm` per (device, dtype)
group (a gradient that must be widened gets its own norm), and the gradients are scaled by
`min(max_norm / (norm + 1e-6), 1)` as a tensor with one `_foreach_mul_` per group, so nothing waits for the device to
decide whether to clip (reading the norm on the host would stall a GPU's queue every step), and a model of N
tensors launches a few kernels instead of 2N.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .. import layout
from ..comm.base import ReduceOp
from ..placement import comm_device
from ..sharded_tensor import local

__all__ = ["clip_grad_norm_", "global_grad_norm"]


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


def _norms(tensors: list[torch.Tensor], norm_type: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Each tensor's p-norm in `dtype`, as one vector on `device`: one foreach kernel per (device, dtype) group
    already in `dtype`, one norm per tensor that must be widened; one stack and one move per group."""
    parts = [torch.zeros(0, dtype=dtype, device=device)]
    for (_, group_dtype), group in _by_device_and_dtype(tensors).items():
        if group_dtype == dtype:
            norms = torch._foreach_norm(group, norm_type)
        else:
            norms = [torch.linalg.vector_norm(g, norm_type, dtype=dtype) for g in group]
        parts.append(torch.stack(norms).to(device))
    return torch.cat(parts)


@torch.no_grad()
def global_grad_norm(model: nn.Module, norm_type: float = 2.0) -> torch.Tensor:
    """The single-process gradient norm of `model` (collective over the model's groups)."""
    norm_type = float(norm_type)
    pls = list(layout.placements(model).values())
    # The pieces this rank holds (a sharded gradient answers for the whole tensor; its norm is over the piece).
    held = [(pl, local(pl.param.grad)) for pl in pls if pl.param.grad is not None]
    grads = [g for _, g in held if g.numel()]
    counted = [g for pl, g in held if g.numel() and layout.counts_here(pl)]
    device = pls[0].param.device if pls else torch.device("cpu")
    # Every rank must reduce in the same dtype: decided from the model's parameters, which every rank holds alike.
    dtype = torch.float64 if any(pl.param.dtype == torch.float64 for pl in pls) else torch.float32
    if math.isinf(norm_type):
        values = _norms(grads, norm_type, dtype, device)
        total = (values.max() if values.numel() else torch.zeros((), dtype=dtype, device=device)).reshape(1)
        op = ReduceOp.MAX
    else:
        total = _norms(counted, norm_type, dtype, device).pow(norm_type).sum().reshape(1)
        op = ReduceOp.SUM
    for group in layout.reduction_groups(model):
        # Reduced on the group's device: with cpu_offload the gradients are on CPU while NCCL reduces on the GPU.
        total = total.to(comm_device(group))
        group.all_reduce(total, op)
    return total[0] if math.isinf(norm_type) else total[0] ** (1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale gradients so their global norm is at most `max_norm`; return the global norm (before clipping).

    Works for plain, DDP, ZeRO / FSDP, tensor-parallel, pipeline and composed models; collective.
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(f"clip_grad_norm_: max_norm={max_norm!r} must be a positive number")
    if not layout.strategies(model):  # one process: exactly torch's computation
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    norm = global_grad_norm(model, norm_type)
    # A tensor, clamped at 1 (no host read of the norm); moved to each group's device (the norm may sit on the GPU,
    # offloaded gradients on CPU). Multiplying by 1.0 leaves a gradient bit for bit as it was.
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    grads = [local(pl.param.grad) for pl in layout.placements(model).values() if pl.param.grad is not None]
    for (device, _), group in _by_device_and_dtype([g for g in grads if g.numel()]).items():
        torch._foreach_mul_(group, coef.to(device))
    return norm
