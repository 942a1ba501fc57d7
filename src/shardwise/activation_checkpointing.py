"""Activation checkpointing, the one implementation every strategy uses (the sharding engine, the 3-D composition).

A checkpointed module keeps only its inputs from the forward pass; backward runs its forward again to rebuild the
activations it needs (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"), trading about one more
forward of compute for the activation memory of the module. torch.utils.checkpoint does the work, non-reentrant
(use_reentrant=False): it composes with autograd hooks (DDP's, the sharding engine's) and with inputs that need no
gradient, which the reentrant variant does not.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["checkpoint_module", "is_checkpointed", "checkpoint_every", "check_interval", "every_kth"]

_MARK = "_shardwise_checkpointed"


def checkpoint_module(module: nn.Module) -> nn.Module:
    """Recompute `module`'s activations in backward instead of storing them (in place; idempotent)."""
    if getattr(module, _MARK, False):
        return module
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward
    object.__setattr__(module, _MARK, True)
    return module


def is_checkpointed(module: nn.Module) -> bool:
    return bool(getattr(module, _MARK, False))


def check_interval(value: object, who: str) -> int:
    """`activation_checkpointing` as an interval: False -> 0 (none), True -> 1 (every unit / layer), k -> every k-th
    (the design documents' CheckpointInterval). Anything else is a ValueError naming the value."""
    if isinstance(value, bool):
        return int(value)
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"{who}: activation_checkpointing={value!r} must be True, False or a positive int k "
                         f"(checkpoint every k-th unit)")
    return value


def every_kth(items: list, interval: int) -> list:
    """The k-th, 2k-th, ... of `items` (all of them for k = 1, none for 0): which units or layers to checkpoint."""
    return items[interval - 1 :: interval] if interval > 0 else []


def checkpoint_every(modules: list[nn.Module], interval: int) -> list[nn.Module]:
    """Checkpoint every `interval`-th module of `modules`; returns them."""
    chosen = every_kth(modules, interval)
    for module in chosen:
        checkpoint_module(module)
    return chosen
