"""Submodules of a unit called from outside the unit's forward: they gather the unit for that call.

Why. A unit is gathered in the pre-forward hook of the modules that bracket it (a transformer block) and freed after
it. A model may also call a module *inside* a unit from elsewhere: Peebles & Xie's DiT (diffusers'
`DiTTransformer2DModel`) computes its output layer's conditioning with `transformer_blocks[0].norm1.emb(...)` after
every block ran. That call found block 0's unit freed, so its layers computed with this rank's flat pieces: refused
by name (sharded_tensor.py), and the model could not train under ZeRO-3 / FSDP with a unit per block. The same holds
for the root unit (the parameters no block holds) when a script calls one of its modules before the model's forward:
`model.get_input_embeddings()(ids)` to build `inputs_embeds` (prompt tuning, spliced image features), a T5's
`model.encoder(ids)` for sentence embeddings, `model.model(ids)` for hidden states. DeepSpeed's
ZeRO-3 serves such calls because it hooks every submodule; hooking every submodule for every forward costs a Python
call per module call and a graph break per module under torch.compile.

How. During the model's first forward, every module with parameters inside a unit (below the modules that bracket
it) carries a discovery hook. A call that finds its unit not entered (outside the unit's forward, not in a
recomputation) is an *entry*: the engine's pre-forward runs for the unit (gather, swap in, the inputs marked for
the unit's backward), without prefetching the unit that follows it in forward order, and its post-forward after the
call (reshard one unit late, the outputs hooked for the backward re-gather), as for a unit used twice in one
forward. After the first forward only the entries keep their hooks. An entry first taken after the first forward
(a path the first forward did not take) is still refused by name. torch.compile traces the hooks (two attribute
reads inside a unit: no graph break; an entry runs eagerly), and removing them after the first forward recompiles
once (tests/test_compile.py's GPT: 5 graphs instead of 4).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ..compiled import eager_while_traced
from .unit import Unit

__all__ = ["InnerCalls"]


class InnerCalls:
    """The discovery hooks and the entries of one sharded model (see the module docstring)."""

    def __init__(self, model: nn.Module, units: list[Unit], inside: Callable[[Unit], bool],
                 pre_forward: Callable[..., tuple[tuple, dict]], post_forward: Callable[[Unit, Any], Any],
                 handles: list[Any]) -> None:
        # inside(unit): the unit is in its forward (for the root unit: the model's) or in a backward's recomputation
        self.inside, self.pre_forward, self.post_forward = inside, pre_forward, post_forward
        tops = {m for unit in units for m in unit.modules}
        owner: dict[nn.Module, Unit] = {}
        for unit in units:  # plan order (the root last): a unit nested in another's subtree comes first
            for top in unit.modules:
                for module in top.modules():
                    owner.setdefault(module, unit)
        self.open: dict[nn.Module, int] = {}  # entries in progress, per module (a module may call itself)
        self.entries: set[nn.Module] = set()
        self.hooks: dict[nn.Module, list[Any]] = {}
        for module, unit in owner.items():
            if module not in tops and next(module.parameters(), None) is not None:
                # Traced by torch.compile (a flag read: no graph break inside the unit); an entry runs eagerly.
                self.hooks[module] = [
                    module.register_forward_pre_hook(self._make_pre(unit), with_kwargs=True, prepend=True),
                    module.register_forward_hook(self._make_post(unit), prepend=True)]
        self.settling = model.register_forward_hook(eager_while_traced(self._settle)) if self.hooks else None
        self.enter, self.leave = eager_while_traced(self._enter), eager_while_traced(self._leave)
        handles += [h for hooks in self.hooks.values() for h in hooks] + ([self.settling] if self.settling else [])

    def _make_pre(self, unit: Unit) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            if self.inside(unit):
                return None  # inside the unit's forward, or its recomputation: the unit is gathered
            return self.enter(unit, module, args, kwargs)

        return hook

    def _make_post(self, unit: Unit) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            return self.leave(unit, module, output) if self.open.get(module) else None

        return hook

    def _enter(self, unit: Unit, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self.entries.add(module)
        self.open[module] = self.open.get(module, 0) + 1
        return self.pre_forward(unit, args, kwargs, prefetch=False)

    def _leave(self, unit: Unit, module: nn.Module, output: Any) -> Any:
        self.open[module] -= 1
        return self.post_forward(unit, output)

    def _settle(self, *_: Any) -> None:
        """After the first forward: only the entries keep their hooks (with the engine's handles, removed with them)."""
        for module, hooks in self.hooks.items():
            if module not in self.entries:
                for hook in hooks:
                    hook.remove()
        self.hooks = {}
        if self.settling is not None:
            self.settling.remove()
            self.settling = None
