"""Methods of the wrapped model that compute like its forward: `forward_methods=("encode_image", ...)`.

Why. A wrapper does its work in the model's forward hooks: ZeRO-3 / FSDP gather the root unit's parameters (those
no smaller unit holds) when `model(...)` starts and free them when it ends; every wrapper checks buffers, batch
statistics and labels there. A model used through another method never enters them: CLIP's `encode_image` /
`encode_text` (retrieval, zero-shot evaluation, a frozen tower computing targets), a VAE's `encode` / `decode`,
a HuggingFace model's `get_image_features`. Under ZeRO-3 / FSDP such a method reads this rank's flat piece where it
needs the whole weight and raises, naming the piece (sharded_tensor.py); under ZeRO-1/2 it raises too, and under DDP
it escapes the forward's checks.

How. As FSDP2's `register_fsdp_forward_method` does, each named method is replaced, on this instance, by one that
calls the model itself (`nn.Module.__call__`: every forward pre-hook and hook runs, with the method's arguments, and
so does every wrapper's own `forward`, which a mixin layer below them, `RoutedForward`, turns into the method for
that call). A call from inside a forward of the model (CLIP's own forward calls `encode_image`) runs the method as
it is: the hooks already ran. A call of the model inside the method (HuggingFace's `generate` calls it once per
token) is a nested forward, which the sharding engine's root hooks let pass (`hook_tools.register_outermost`). Call
`route_through_forward` before the wrapper mixes in its own class, so the layer sits below it.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from ._mixin import mix_in

__all__ = ["check_forward_methods", "count_calls", "route_through_forward", "RoutedForward", "with_generate"]

_ROUTED = "_sw_routed_method"  # the method the next forward runs instead of the model's own (this instance only)


class RoutedForward(nn.Module):
    """Mixed in under the wrappers' classes: a forward runs the routed method, once, if one was set."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        method = self.__dict__.pop(_ROUTED, None)  # popped: a forward the method itself calls is the model's own
        if method is not None:
            return method(*args, **kwargs)
        return super().forward(*args, **kwargs)


def check_forward_methods(module: nn.Module, names: Any, who: str) -> tuple[str, ...]:
    """The method names, validated at wrap time: a tuple (or list) of names of methods of `module`'s class."""
    if names is None:
        return ()
    if isinstance(names, str) or not isinstance(names, (tuple, list)) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{who}: forward_methods={names!r} must be a tuple of method names of the model, e.g. "
                         f"forward_methods=('encode_image', 'encode_text')")
    for name in names:
        if name == "forward" or name.startswith("_") or not callable(getattr(type(module), name, None)):
            methods = sorted(n for n in dir(type(module)) if not n.startswith("_") and n not in dir(nn.Module)
                             and callable(getattr(type(module), n, None)))
            raise ValueError(f"{who}: forward_methods entry {name!r} is not a public method of "
                             f"{type(module).__name__} other than forward; its own methods are {methods}")
    return tuple(names)


def with_generate(module: nn.Module, names: tuple[str, ...]) -> tuple[str, ...]:
    """`names`, with HuggingFace's `generate` added for a model that can generate (ZeRO / FSDP route it unasked):
    an encoder-decoder's generation calls its encoder directly, and a decoder-only one calls the forward once per
    token, which would gather the root unit (embeddings, output head: the model's largest tensors) for every token;
    routed, the root is gathered once per generation (16 tokens of a 2-layer Llama: 33 all-gathers instead of 48)."""
    can_generate = getattr(module, "can_generate", None)
    if "generate" in names or not callable(getattr(type(module), "generate", None)) or not callable(can_generate):
        return names
    return (*names, "generate") if can_generate() else names


def count_calls(module: nn.Module, handles: list[Any] | None = None) -> list[int]:
    """A one-element list holding how many calls of `module` are running now (nested ones included). Its pre-hook
    goes first of those registered so far and its post-hook last, and runs even when the forward raised (the count
    goes back to zero). The hooks' handles are appended to `handles` when given."""
    depth = [0]

    def enter(*_: Any) -> None:
        depth[0] += 1

    def leave(*_: Any) -> None:
        depth[0] -= 1

    made = [module.register_forward_pre_hook(enter, prepend=True),
            module.register_forward_hook(leave, always_call=True)]
    if handles is not None:
        handles += made
    return depth


def route_through_forward(module: nn.Module, names: tuple[str, ...]) -> None:
    """Make each named method of `module` (this instance) run as the model's forward: see the module docstring."""
    if not names:
        return
    mix_in(module, RoutedForward, "Routed")
    depth = count_calls(module)  # a method called inside a forward of the model needs no hooks of its own
    for name in names:
        method = getattr(type(module), name).__get__(module)
        setattr(module, name, _routed(module, method, depth))


def _routed(module: nn.Module, method: Any, depth: list[int]) -> Any:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        if depth[0]:
            return method(*args, **kwargs)
        module.__dict__[_ROUTED] = method
        try:
            return module(*args, **kwargs)  # the hooks, the wrappers' forwards, then RoutedForward runs the method
        finally:
            module.__dict__.pop(_ROUTED, None)  # a pre-hook that raised left it set

    return call
