"""torch's random functions other than dropout, drawing from the tensor-parallel stream inside a split model's forward.

Why. A random op in a region every rank of a tensor-parallel group computes alike (a Mixtral or PhiMoE router's
jitter noise, ``hidden *= torch.empty_like(hidden).uniform_(1 - eps, 1 + eps)``; stochastic depth's
``torch.rand``) must give every rank the same numbers, or the ranks route, scale or drop differently and their
copies of the replicated parameters drift apart with no error (dropout_stream.py says why torch's generator does not
give that). So, next to the dropout functions (dropout_functions.py), `patch_random` replaces torch's random
factories and in-place samplers with wrappers that, inside a split model's forward and given no generator, pass one
from the group's stream (dropout_stream.generator_for_random); everywhere else they are torch's functions unchanged.
Such a draw cannot be replayed in an activation-checkpointing recompute (a RuntimeError there, not other numbers).
Thread ranks' own streams serve dropout only: a script's ``torch.manual_seed`` keeps governing its other draws.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import torch

from .compiled import eager_while_traced
from .dropout_stream import generator_for_random

__all__ = ["patch_random", "RANDOM_ORIGINALS"]

RANDOM_ORIGINALS: dict[str, Callable] = {}
_FACTORIES = ("rand", "randn", "randint", "randperm", "bernoulli", "normal", "multinomial", "poisson")
_LIKE = {"rand_like": "rand", "randn_like": "randn"}
_METHODS = ("uniform_", "normal_", "bernoulli_", "exponential_", "geometric_", "log_normal_", "cauchy_", "random_",
            "bernoulli", "multinomial")
_lock = threading.Lock()


def _device(args: tuple, kwargs: dict) -> Any:
    if kwargs.get("device") is not None:
        return torch.device(kwargs["device"])
    tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return tensor.device if tensor is not None else torch.get_default_device()


def _unseeded(args: tuple, kwargs: dict) -> bool:
    return kwargs.get("generator") is None and not any(isinstance(a, torch.Generator) for a in args)


@eager_while_traced  # under torch.compile a graph break: a generator object cannot enter a graph
def _from_stream(original: Callable, kind: str, device: Any, args: tuple, kwargs: dict) -> Any:
    """`original` with a generator from the group's stream where one serves (dropout_stream.generator_for_random)."""
    generator = generator_for_random(device, kind)
    return original(*args, **kwargs) if generator is None else original(*args, **kwargs, generator=generator)


def _factory(name: str, original: Callable, *args: Any, **kwargs: Any) -> Any:
    if _unseeded(args, kwargs):
        return _from_stream(original, f"torch.{name}", _device(args, kwargs), args, kwargs)
    return original(*args, **kwargs)


def _like(name: str, base: Callable, original: Callable, input: torch.Tensor, *, dtype: Any = None,
          layout: Any = None, device: Any = None, requires_grad: bool = False, **kwargs: Any) -> torch.Tensor:
    """rand_like / randn_like through their base factory, which takes a generator on every torch since 2.4."""
    if _unseeded((), kwargs) and layout is None and set(kwargs) <= {"generator", "memory_format"}:
        return _from_stream(base, f"torch.{name}", device if device is not None else input.device, (input.shape,),
                            dict(dtype=dtype or input.dtype, device=device if device is not None else input.device,
                                 requires_grad=requires_grad))
    return original(input, dtype=dtype, layout=layout, device=device, requires_grad=requires_grad, **kwargs)


def _method(name: str, original: Callable, self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    if _unseeded(args, kwargs):
        return _from_stream(original, f"Tensor.{name}", self.device, (self, *args), kwargs)
    return original(self, *args, **kwargs)


def patch_random() -> None:
    """Put the wrappers in place of torch's (idempotent; torch's stay in RANDOM_ORIGINALS)."""
    with _lock:
        if RANDOM_ORIGINALS:
            return
        for name in _FACTORIES:
            original = RANDOM_ORIGINALS[name] = getattr(torch, name)
            setattr(torch, name, functools.wraps(original)(functools.partial(_factory, name, original)))
        for name, base in _LIKE.items():
            original = RANDOM_ORIGINALS[name] = getattr(torch, name)
            wrapper = functools.partial(_like, name, RANDOM_ORIGINALS[base], original)
            setattr(torch, name, functools.wraps(original)(wrapper))
        for name in _METHODS:
            original = RANDOM_ORIGINALS[f"Tensor.{name}"] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, _as_method(name, original))


def _as_method(name: str, original: Callable) -> Callable:
    @functools.wraps(original)
    def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return _method(name, original, self, *args, **kwargs)

    return method
