"""Wrapping a torch.compile()d module is refused: compile the wrapped model instead.

`torch.compile(model)` returns an OptimizedModule whose forward runs graphs dynamo traced from the original module.
A strategy wrapping that object would install its hooks and replace parameters on the inner module after (or
while) dynamo captured it: DDP's forward never ran at all in nanoGPT's order (0 of 82 calls, issue 29), and a
sharding engine's parameter swaps would meet guards recorded for other tensors. The order that works is the other
one, wrap first, then `torch.compile(wrapped)`: the engine's hooks then run eagerly between compiled graphs
(sharding/engine.py), and tests/test_compile.py checks that such a model trains exactly as eager.

`eager_while_traced(function)` is how those hooks (and the dropout stream's, tensor_parallel's layers) stay out of
the graphs: see its docstring. `graph_tracing` and `break_graph_here` serve the functions shardwise puts in torch's
place (dropout_functions.py, random_functions.py), which dynamo may keep in its graph as the torch functions they
replace rather than trace through.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NoReturn

import torch
from torch import nn

__all__ = ["refuse_compiled", "eager_while_traced", "graph_tracing", "break_graph_here"]


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

    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_dynamo_compiling():
            return torch._dynamo.disable(function, recursive=True)(*args, **kwargs)
        return function(*args, **kwargs)

    # A code object of its own for each function: dynamo compiles `run` where eager code calls it under a compiled
    # model, keeps what it compiled on the code object, guarded on `function`, and gave up past its recompile limit
    # (8 functions share one code, with a warning) when every wrapper shared one
    run.__code__ = run.__code__.replace(co_name=f"eager_{getattr(function, '__name__', 'call')}")
    return functools.wraps(function)(run)


def graph_tracing() -> str | None:
    """How torch.compile's machinery runs the calling code, below dynamo's bytecode tracing (which
    `is_dynamo_compiling` answers): "graph" while make_fx / AOTAutograd record every op into a graph (a proxy dispatch
    mode is on: AOTAutograd tracing a function dynamo kept whole in its graph, inductor tracing its own replacement
    patterns at its first compile), "example" while dynamo runs such a function on fake tensors to learn its output
    (a fake mode only), None when the code runs for real.

    Why it matters. Dynamo keeps a function found under a torch name in its graph whole
    (``torch.nn.functional.dropout``, ``torch.rand``: its table maps names to "in graph" when first built, after
    shardwise replaced them) and traces it later; a draw from the tensor-parallel dropout stream traced so would
    become torch's own draw (inductor's random, another mask on every rank) or a generator object no backend can
    hold (inductor failed: "While executing %_opaque_obj0")."""
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None:
        return "graph"
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
        return "example"
    return None


def break_graph_here() -> NoReturn:
    """In dynamo's example run (`graph_tracing` "example"): leave this call out of the graph and run it eagerly, by
    the exception dynamo answers with a graph break (the one an op whose result depends on tensor data raises under
    fake tensors, which is what a stream draw is: its seed is looked up by its input's fingerprint, a scalar read)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    raise DataDependentOutputException(torch.ops.aten._local_scalar_dense.default)
