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

Hooks registered *after* wrapping, on what `model.parameters()` then yields, are run by the strategy where the
gradient they are about becomes the step's averaged one (`run_gradient_hooks`): under ZeRO / FSDP the parameters
are the shard parameters, which autograd never reaches (the forward computes with the unsharded copies), so
autograd would never run them; the engine runs each `register_hook` hook on the averaged piece before adding it to
`.grad` and each post-accumulate-grad hook after (optimizer-in-backward: `p.register_post_accumulate_grad_hook(
lambda p: opts[p].step())`), as FSDP2 runs the latter (pytorch/pytorch#129450). Under DDP the parameters are the
model's own, so autograd runs their hooks (registered before or after wrapping) on this rank's gradient; DDP holds
them back (`hold_back_hooks`) and runs them once the averaged gradient is in `.grad`, where torch DDP lets them see
the rank's own.

Reads torch's own per-tensor hook tables (`Tensor._backward_hooks`, `Tensor._post_accumulate_grad_hooks`): torch has
no public way to list a tensor's hooks.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

__all__ = ["carry_grad_hooks", "internal_hook", "hook_even_if_frozen", "run_gradient_hooks", "has_gradient_hooks",
           "hold_back_hooks", "HeldBack", "run_post_accumulate_hooks"]

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
    if _users(old, "_post_accumulate_grad_hooks"):
        raise ValueError(f"{who}: parameter {name!r} has a post-accumulate-grad hook (register_post_accumulate_grad_"
                         f"hook); {who} replaces the parameter and assigns its .grad, so the hook would never run. "
                         f"Register it after wrapping, on the parameter model.parameters() then yields: it runs when "
                         f"the averaged gradient is in that parameter's .grad")
    if old is new:
        return
    for hook in _users(old, "_backward_hooks"):
        hook_even_if_frozen(new, "register_hook", hook)


def _users(param: torch.Tensor, table: str) -> list:
    """The hooks in `param`'s torch table `table` that are not shardwise's own (`internal_hook`)."""
    with torch._C.DisableTorchFunctionSubclass():  # a sharded piece's table: a plain attribute read
        hooks = getattr(param, table, None)
    return [h for h in (hooks or {}).values() if not getattr(h, _INTERNAL, False)]


def has_gradient_hooks(param: torch.Tensor) -> bool:
    """Whether `param` carries any gradient hook at all (a cheap test before `run_gradient_hooks`: two reads)."""
    with torch._C.DisableTorchFunctionSubclass():  # a sharded piece's tables: plain attribute reads
        return bool(param._backward_hooks or param._post_accumulate_grad_hooks)


def run_gradient_hooks(param: torch.Tensor, grad: torch.Tensor, add: Callable[[torch.Tensor], None]) -> None:
    """Give `param` the averaged gradient `grad` as autograd would have: each of its `register_hook` hooks on `grad`
    (a hook may return a replacement), then `add(grad)` (the strategy's accumulation into `.grad`), then each
    post-accumulate-grad hook on `param`. Only the hooks a user put on `param` (module docstring)."""
    for hook in _users(param, "_backward_hooks"):
        out = hook(grad)
        grad = grad if out is None else out
    add(grad)
    for hook in _users(param, "_post_accumulate_grad_hooks"):
        hook(param)


def run_post_accumulate_hooks(param: torch.Tensor) -> None:
    """Run every post-accumulate-grad hook of `param`, shardwise's own and a user's, as autograd's AccumulateGrad
    does once it added a gradient into `.grad`: for code that adds a gradient `torch.autograd.grad` computed itself
    (a zero-bubble pipeline's weight pass, pipeline/split_backward.py), where autograd runs none (a tensor-parallel
    slice's gradient then stayed a plain tensor; DDP's own hooks and a user's optimizer-in-backward never ran)."""
    with torch._C.DisableTorchFunctionSubclass():  # a sharded piece's table: a plain attribute read
        hooks = list(param._post_accumulate_grad_hooks.values()) if param._post_accumulate_grad_hooks else []
    for hook in hooks:
        hook(param)


class HeldBack:
    """A user's gradient hook on a DDP parameter, held back while a synchronised backward runs: autograd calls it
    with this rank's gradient; it records the call instead (a `register_hook` hook passes the gradient on
    unchanged), and DDP runs the recorded calls, in their order, once the averaged gradients are in `.grad`
    (`release`): a hook then sees one process's gradient, whatever it computes (a clamp as well as a mask).
    It runs at once, on this rank's gradient as in torch DDP, under `no_sync()` (nothing is averaged yet), in a
    backward building a graph (`create_graph=True`), and for a `register_hook` hook of a parameter whose `.grad`
    already holds a gradient (accumulation: the hook is about this backward's part alone)."""

    def __init__(self, hook: Callable, holding: Callable[[], list | None], param: torch.Tensor, pre: bool) -> None:
        self.hook, self.holding, self.pre = hook, holding, pre
        self.param = weakref.ref(param)  # a pre-hook is called with the gradient only

    def __call__(self, arg: torch.Tensor) -> torch.Tensor | None:
        held, param = self.holding(), self.param()
        if held is None or torch.is_grad_enabled() or (self.pre and (param is None or param.grad is not None)):
            return self.hook(arg)
        held.append((self, param if self.pre else arg))
        return None

    def release(self, param: torch.Tensor) -> None:
        """Run the held hook on `param`'s averaged gradient (a returned replacement is copied into `.grad`)."""
        if param.grad is None:
            return
        if not self.pre:
            self.hook(param)
            return
        out = self.hook(param.grad)
        if out is not None and out is not param.grad:
            with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
                param.grad.copy_(out)


def hold_back_hooks(params: list[torch.Tensor], holding: Callable[[], list | None]) -> None:
    """Replace each user gradient hook of `params` (`register_hook` and post-accumulate-grad) not yet held back by a
    `HeldBack` of it, in place in torch's tables (its handle still removes it). Two length checks per parameter when
    there is nothing to do (DDP's own two hooks are always there)."""
    for p in params:
        with torch._C.DisableTorchFunctionSubclass():  # a tensor-parallel slice's tables: plain attribute reads
            tables = ((p._backward_hooks, True), (p._post_accumulate_grad_hooks, False))
        for table, pre in tables:
            if not table or len(table) < 2:
                continue
            for key, hook in list(table.items()):
                if not isinstance(hook, HeldBack) and not getattr(hook, _INTERNAL, False):
                    table[key] = HeldBack(hook, holding, p, pre)
