"""Wrapping a torch.compile()d module is refused: compile the wrapped model instead.

`torch.compile(model)` returns an OptimizedModule whose forward runs graphs dynamo traced from the original module.
A strategy wrapping that object would install its hooks and replace parameters on the inner module after (or
while) dynamo captured it: DDP's forward never ran at all in nanoGPT's order (0 of 82 calls, issue 29), and a
sharding engine's parameter swaps would meet guards recorded for other tensors. The order that works is the other
one, wrap first, then `torch.compile(wrapped)`: the engine's hooks then run eagerly between compiled graphs
(sharding/engine.py), and tests/test_compile.py checks that such a model trains exactly as eager.
"""

from __future__ import annotations

from torch import nn

__all__ = ["refuse_compiled"]


def refuse_compiled(module: nn.Module, who: str) -> None:
    """Raise ValueError when `module` is the result of torch.compile (see the module docstring)."""
    if hasattr(module, "_orig_mod") and type(module).__name__ == "OptimizedModule":
        inner = type(module._orig_mod).__name__
        raise ValueError(f"{who}: the module is a torch.compile()d {inner} (an OptimizedModule): its compiled graphs "
                         f"would bypass the wrapper's hooks. Wrap the plain model first, then compile what the "
                         f"wrapper returns (torch.compile(wrapped)); or pass model._orig_mod here")
