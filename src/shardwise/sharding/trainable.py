"""Which parameters the sharding units train, following `requires_grad` when a script freezes or unfreezes layers.

Fine-tuning scripts change `requires_grad` between steps: a frozen backbone unfrozen after a few epochs (gradual
unfreezing, Howard & Ruder 2018, "Universal Language Model Fine-tuning"), a layer frozen part-way. In one process
autograd simply follows the flag: a frozen parameter gets no gradient, keeps its `.grad` (None after zero_grad) and
every torch optimizer skips it. A unit's layout was built from the flags at wrap time (which parameters get a
gradient hook, a slot in the flat gradient buffer's flag band); before each step's first forward the engine asks
`TrainableSet.follow`, which makes every changed unit follow the shard parameters' flags (unit.py
`follow_requires_grad`) and hooks the parameters that became trainable. Checking costs one attribute read per
parameter per forward. A change between backward passes accumulated under `no_sync()` is refused: part of the
step's gradient would be averaged and part not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..graph_gradients import average_when_building_graph
from .param_info import ParamInfo
from .unit import Unit

__all__ = ["TrainableSet"]


class TrainableSet:
    """The gradient hooks of every unit's trainable parameters, kept in step with `requires_grad` (module docstring).
    `make_hook(unit, info)` returns the hook; `handles` collects the handles (the engine removes them on unwrap)."""

    def __init__(self, units: list[Unit], make_hook: Callable[[Unit, ParamInfo], Any], handles: list[Any]) -> None:
        self.units = units
        self.make_hook = make_hook
        self.handles = handles
        self.hooked: set[int] = set()  # id of each unsharded parameter carrying a hook (it stays when frozen)
        for unit in units:
            self._hook(unit, unit.trainable)

    def _hook(self, unit: Unit, infos: list[ParamInfo]) -> None:
        for info in infos:
            if id(info.unsharded) not in self.hooked:
                self.handles.append(info.unsharded.register_post_accumulate_grad_hook(self.make_hook(unit, info)))
                # torch.autograd.grad(..., create_graph=True) gets the data-parallel average (graph_gradients.py)
                self.handles.append(info.unsharded.register_hook(
                    average_when_building_graph((unit.shard_comm, unit.replicate_comm))))
                self.hooked.add(id(info.unsharded))

    def follow(self, accumulating: bool, who: str) -> None:
        """Before a step's forward: every unit whose parameters' `requires_grad` changed follows them."""
        changed = [unit for unit in self.units if unit.requires_grad_changed()]
        if not changed:
            return
        if accumulating:
            names = [i.name for u in changed for i in u.infos if i.shard_param.requires_grad is not i.requires_grad]
            raise ValueError(f"{who}: requires_grad of {names[:8]} changed between backward passes accumulated "
                             f"under no_sync() (or a pipeline's microbatches); freeze or unfreeze parameters after "
                             f"the optimizer step, before the next step's first forward")
        for unit in changed:
            self._hook(unit, unit.follow_requires_grad())
