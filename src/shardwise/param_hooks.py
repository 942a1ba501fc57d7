"""Gradient hooks a user registered on a parameter survive a strategy that replaces the parameter object.

ZeRO / FSDP compute with their own unsharded parameters (views of the gathered buffer) and tensor parallel with the
new layers' slices, so a hook registered on the original parameter before wrapping (`p.register_hook(fn)`: a
gradient mask, a per-parameter scale, sequence parallel's partial-gradient sum) would silently never run. Each such
hook is registered again, in order, on the tensor that now receives the gradient; it sees the gradient of the full
parameter under ZeRO / FSDP (the unsharded copy) and of this rank's slice under tensor parallel (a hook that needs
the full shape fails there loudly, as it should). A post-accumulate-grad hook cannot follow: the parameter the
optimizer sees gets its `.grad` assigned by the strategy, never accumulated, so such a hook would never fire; the
wrap refuses it naming the parameter. Hooks shardwise itself put there (marked by `internal_hook`: a
tensor-parallel slice re-describing its gradient) belong to the old parameter and stay behind.

Reads torch's own per-tensor hook tables (`Tensor._backward_hooks`, `Tensor._post_accumulate_grad_hooks`): torch has
no public way to list a tensor's hooks.
"""

from __future__ import annotations

import torch

__all__ = ["carry_grad_hooks", "internal_hook", "hook_even_if_frozen"]

_INTERNAL = "_shardwise_internal_hook"


def internal_hook(fn):  # noqa: ANN001, ANN201
    """Mark `fn` as a hook of shardwise's own, which `carry_grad_hooks` neither carries nor refuses."""
    setattr(fn, _INTERNAL, True)
    return fn


def hook_even_if_frozen(param: torch.Tensor, register: str, hook) -> None:  # noqa: ANN001 - a torch hook
    """`param.<register>(hook)` (`register_hook` or `register_post_accumulate_grad_hook`) whether or not `param`
    requires grad now: a script may unfreeze it after wrapping (gradual unfreezing), and the hook must be there
    then. torch refuses a hook on a tensor that does not require grad, but keeps one registered while it did, so
    the flag is raised around the registration. A parameter that cannot require grad (integer) gets none."""
    if param.requires_grad:
        getattr(param, register)(hook)
    elif param.is_floating_point() or param.is_complex():
        param.requires_grad_(True)
        try:
            getattr(param, register)(hook)
        finally:
            param.requires_grad_(False)


def carry_grad_hooks(old: torch.Tensor, new: torch.Tensor, name: str, who: str) -> None:
    """Register `old`'s gradient hooks on `new` (see the module docstring); ValueError for a post-accumulate hook."""
    post_hooks = (getattr(old, "_post_accumulate_grad_hooks", None) or {}).values()
    if any(not getattr(h, _INTERNAL, False) for h in post_hooks):
        raise ValueError(f"{who}: parameter {name!r} has a post-accumulate-grad hook (register_post_accumulate_grad_"
                         f"hook); {who} replaces the parameter and assigns its .grad, so the hook would never run. "
                         f"Register a gradient hook (p.register_hook) instead, or act on .grad after backward")
    if old is new:
        return
    for hook in (getattr(old, "_backward_hooks", None) or {}).values():
        if not getattr(hook, _INTERNAL, False):
            hook_even_if_frozen(new, "register_hook", hook)
