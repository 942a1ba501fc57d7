"""Give one module instance extra behaviour by swapping its class for a cached subclass (`Mixin` + its class).

DDP, the sharding engine and the tensor-parallel GPT forward all wrap a model *in place*: the user keeps the same
object, its parameter names and `state_dict` keys, and an `isinstance(model, GPT)` check still holds. The subclass
is made once per (class, mixin) and cached, so wrapping many models does not create many classes.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

from torch import nn

from .sharded_tensor import local

__all__ = ["mix_in", "original_class", "MovesRefused"]

_CACHE: dict[tuple[type, type], type] = {}
_LOCK = threading.Lock()  # thread ranks wrap their models concurrently


def mix_in(module: nn.Module, mixin: type, prefix: str) -> nn.Module:
    """Make `module` an instance of `type(prefix + ClassName, (mixin, type(module)))` and return it."""
    cls = type(module)
    with _LOCK:
        if (cls, mixin) not in _CACHE:
            body: dict[str, Any] = {"__module__": cls.__module__}
            if "forward" in vars(mixin):
                body["forward"] = _forward_signed_as(mixin, cls)
            _CACHE[(cls, mixin)] = type(f"{prefix}{cls.__name__}", (mixin, cls), body)
        module.__class__ = _CACHE[(cls, mixin)]
    return module


def _forward_signed_as(mixin: type, cls: type) -> Any:
    """The mixin's `forward(*args, **kwargs)` under the signature of the class's own forward. Callers read a
    model's arguments from it: HuggingFace's `generate` passes `cache_position`, `logits_to_keep` and the like only
    to a forward that names them, and under a bare `*args, **kwargs` generated other tokens than the plain model."""
    inner = vars(mixin)["forward"]

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return inner(self, *args, **kwargs)

    forward.__doc__ = inner.__doc__
    forward._sw_mixin_forward = True  # type: ignore[attr-defined]  # not the model's own (experts.hf_kinds)
    try:
        forward.__signature__ = inspect.signature(cls.forward)  # type: ignore[attr-defined]
    except (TypeError, ValueError):  # a forward with no signature to read (a builtin): the mixin's own
        pass
    return forward


def original_class(module: nn.Module) -> type:
    """The class `module` had before any `mix_in`."""
    cls = type(module)
    with _LOCK:
        made = set(_CACHE.values())
    while cls in made:
        cls = cls.__bases__[-1]
    return cls


class MovesRefused(nn.Module):
    """Base of the in-place wrappers (DDP, ZeRO / FSDP): `model.to(...)`, `.half()`, `.cuda()` after wrapping would
    change tensors the wrapper's buffers, shards and hooks point at, so a move that changes anything raises; a no-op
    move (`.to("cpu")` on CPU, `.float()` on fp32) is allowed. `copy.deepcopy` (an EMA copy, torch's
    `deepcopy(model.module)`) raises too, saying how: a copy would hold this rank's shards and the wrapper's hooks
    and communicator, which cannot be copied (it failed with "cannot pickle '_thread.RLock' object")."""

    def __deepcopy__(self, memo: dict) -> nn.Module:
        raise TypeError(f"copy.deepcopy of a wrapped model ({type(self).__name__}): copy the model before wrapping it "
                        f"(ema = copy.deepcopy(model), then wrap model), or load sw.full_state_dict(model) into a "
                        f"plain model")

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 - torch.nn.Module's signature
        probe = next(iter(self.parameters()), None)
        if probe is not None:
            moved = fn(local(probe).detach()[:0])  # an empty probe of its dtype and device
            if moved.dtype != probe.dtype or moved.device != probe.device:
                raise ValueError(f"{type(self).__name__}: cannot move or cast a wrapped model ({probe.dtype} on "
                                 f"{probe.device} -> {moved.dtype} on {moved.device}); move or cast the model before "
                                 f"wrapping it (for mixed precision use sw.MixedPrecision)")
        return super()._apply(fn, recurse)

    def __getitem__(self, index):  # noqa: ANN001, ANN204 - nn.Sequential's / nn.ModuleList's signature
        """A slice of a wrapped nn.Sequential / nn.ModuleList (`model[:3]`, torch DDP's `model.module[:3]`): a plain
        container of the same submodules, as torch DDP's `.module` gives. torch builds the slice with
        `self.__class__(...)`, which made it an instance of the wrapper's class without the wrapper's state (it
        failed with "'DDPSequential' object has no attribute '_ddp'")."""
        getter = getattr(super(), "__getitem__", None)
        if getter is None:
            raise TypeError(f"'{type(self).__name__}' object is not subscriptable")
        out = getter(index)
        if type(out) is type(self):
            out.__class__ = original_class(self)
        return out

    @property
    def module(self) -> nn.Module:
        """torch DDP / FSDP1's `model.module`, the model inside the wrapper: shardwise wraps in place, so it is the
        model itself (a submodule the model names `module` wins, as attribute lookup would give it)."""
        own = self._modules.get("module")
        return own if own is not None else self
