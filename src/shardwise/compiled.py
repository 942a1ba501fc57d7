"""Wrapping a torch.compile()d module is refused: compile the wrapped model instead.

`torch.compile(model)` returns an OptimizedModule whose forward runs graphs dynamo traced from the original module.
A strategy wrapping that object would install its hooks and replace parameters on the inner module after (or
while) dynamo captured it: DDP's forward never ran at all in nanoGPT's order (0 of 82 calls, issue 29), and a
sharding engine's parameter swaps would meet guards recorded for other tensors. The order that works is the other
one, wrap first, then `torch.compile(wrapped)`: the engine's hooks then run eagerly between compiled graphs
(sharding/engine.py), and tests/test_compile.py checks that such a model trains exactly as eager.

`eager_while_traced(function)` is how those hooks (and the dropout stream's, tensor_parallel's layers) stay out of
the graphs: see its docstring.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["refuse_compiled", "eager_while_traced"]


def refuse_compiled(module: nn.Module, who: str) -> None:
    """Raise ValueError when `module` is the result of torch.compile (see the module docstring)."""
    if hasattr(module, "_orig_mod") and type(module).__name__ == "OptimizedModule":
        inner = type(module._orig_mod).__name__
        raise ValueError(f"{who}: the module is a torch.compile()d {inner} (an OptimizedModule): its compiled graphs "
                         f"would bypass the wrapper's hooks. Wrap the plain model first, then compile what the "
                         f"wrapper returns (torch.compile(wrapped)); or pass model._orig_mod here")


def eager_while_traced(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` as it is; while dynamo traces it, a graph break that runs it eagerly, as PyTorch FSDP2's hooks do
    (what the sharding engine's hooks do, gathering and swapping parameters, issuing collectives, and the dropout
    stream's generators and thread-local state cannot enter a graph).

    Why not `torch.compiler.disable(function)` at definition: that imports torch._dynamo on the spot, ~2.7 s of CPU
    per process on a 2-core machine (every rank that wraps a model paid it, compiled or not), and every eager call
    then went through dynamo's disable context. Here dynamo is only touched while it traces, when it is loaded
    anyway. `is_dynamo_compiling`, which dynamo folds to True in what it traces, not `is_compiling`, a process-wide
    flag: one thread rank tracing would divert another running eagerly."""

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_dynamo_compiling():
            return torch._dynamo.disable(function, recursive=True)(*args, **kwargs)
        return function(*args, **kwargs)

    return run
