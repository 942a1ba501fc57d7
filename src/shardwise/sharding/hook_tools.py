"""Small autograd and pytree tools of the sharding engine's hooks (engine.py).

* `MarkBackwardDone`: an identity on a unit's inputs whose backward runs once the gradient w.r.t. those inputs
  exists, i.e. after every operation of the unit that needed its parameters: the moment to free them again (the
  approach of PyTorch FSDP2's post-backward).
* `inside_backward()`: whether the autograd engine is running a backward pass on this thread (activation
  checkpointing recomputes forwards there, which must not count as a new iteration).
* `tensors_in(obj)` / `cast_floating(obj, dtype)`: the tensors of a module's inputs or outputs (nested lists,
  tuples and dicts), and the same structure with its floating tensors cast (mixed precision's compute dtype).
* `register_outermost(model, pre, post, handles)`: the model's root hooks, run for the outermost call only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..forward_methods import count_calls

__all__ = ["MarkBackwardDone", "inside_backward", "tensors_in", "cast_floating", "register_outermost"]


class MarkBackwardDone(torch.autograd.Function):
    """Identity on the unit's inputs; its backward calls `callback` (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, callback: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.callback()
        return (None, *grads)


def inside_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread (recomputation happens there)."""
    return torch._C._current_graph_task_id() != -1


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor of `obj` (a tensor, or lists, tuples and dicts of them), depth first."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_in(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_in(v)]
    return []


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """`obj` with every floating tensor cast to `dtype` (the same nesting; other values unchanged)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return {k: cast_floating(v, dtype) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cast_floating(v, dtype) for v in obj)
    return obj


def register_outermost(model: torch.nn.Module, pre: Callable[..., Any], post: Callable[..., Any],
                       handles: list[Any]) -> None:
    """Register `pre` (a forward pre-hook with kwargs, first of the model's) and `post` (a forward hook) so that they
    run for the outermost call of the model only. A call the model makes inside its own (HuggingFace's `generate`,
    routed through `forward_methods=`, calls the model once per token) is nested: the outer call's pre-hook already
    gathered what the forward needs, and its post-hook will free it. A forward that raised leaves the depth at zero
    (the counting post-hook always runs), so the next call is outermost and finds the previous one unfinished."""
    handles.append(model.register_forward_pre_hook(
        lambda module, args, kwargs: pre(module, args, kwargs) if depth[0] == 1 else None, with_kwargs=True,
        prepend=True))
    handles.append(model.register_forward_hook(
        lambda module, args, output: post(module, args, output) if depth[0] == 1 else None))
    depth = count_calls(model, handles)  # registered after: its pre-hook runs before `pre`, its post-hook after `post`
