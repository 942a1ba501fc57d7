"""Gathered parameters saved for backward outside their unit's forward: waited for before backward reads them.

ZeRO-3 / FSDP gather a unit's parameters in its pre-forward hook and gather them again for its backward in a hook
on the unit's outputs, which fires when their gradient arrives. Autograd runs the nodes of a graph latest-created
first, so a node created after the unit's forward that saved one of its parameters runs before that hook: a
regulariser computed in a forward hook of the module (`(w @ w.T - I).pow(2).sum()`), a parent module's forward that
reads a child unit's weight after the child ran, a loss computed from a layer's weight. Before, such a node read the
parameter while it was freed (torch: "setStorage ... out of bounds") or, when the previous unit's backward had
already started prefetching it, while the all-gather was still writing it: uninitialised values, a silently wrong
gradient (or NaN), more often under load.

`OutsideReads` installs saved-tensor hooks (`torch.autograd.graph.saved_tensors_hooks`) while the forward is outside
every non-root unit; inside a unit nothing is hooked, so the blocks' own activations cost nothing. A tensor saved
there that shares storage with a unit's gathered parameters (the parameter, a transpose or a slice of it) is packed
with its unit, and unpacking it in backward waits for that unit's gather (issuing it if the unit was freed), in the
order of the graph, which every rank shares. Other saved tensors pass through untouched. When another saved-tensor
hook is already active (torch.utils.checkpoint around the whole model, `save_on_cpu`), the hooks are not installed
over it: that forward is not covered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .unit import Unit

__all__ = ["OutsideReads"]

_autograd = torch._C._autograd
_TOP = getattr(_autograd, "_top_saved_tensors_default_hooks", None)  # absent in older torch: never install


class _Saved:
    """A saved tensor sharing storage with `unit`'s gathered parameters."""

    __slots__ = ("unit", "tensor")

    def __init__(self, unit: Unit, tensor: torch.Tensor) -> None:
        self.unit, self.tensor = unit, tensor


class OutsideReads:
    """The hooks of one sharded model (module docstring). The engine calls `begin_forward` / `end_forward` at the
    root's forward, `enter_unit` / `leave_unit` at each non-root unit's, and `reset` when it recovers."""

    def __init__(self, families: dict[Unit, tuple[Unit, ...]], gather: Callable[[Unit], None]) -> None:
        # The family (its first unit, what `gather` takes) of each unit whose gathered storage is freed between
        # forward and backward, by the identity of that storage (kept across the free and the next gather: resizing
        # keeps the storage object).
        self.owner = {part.full.untyped_storage()._cdata: first for first, family in families.items()
                      for part in family if not part.is_root and not part.keep_full and part.numel > 0}
        self.gather = gather
        self.units_open = 0
        self.installed = False  # our hooks are in torch's stack of saved-tensor hooks (not necessarily on top)

    def begin_forward(self) -> None:
        self.units_open = 0
        self._install()

    def end_forward(self) -> None:
        self._remove()

    def enter_unit(self) -> None:
        self.units_open += 1
        if self.units_open == 1:
            self._remove()

    def leave_unit(self) -> None:
        self.units_open = max(self.units_open - 1, 0)
        if self.units_open == 0:
            self._install()

    def reset(self) -> None:
        self.units_open = 0
        self._remove()

    def _install(self) -> None:
        if self.installed or not self.owner or _TOP is None or not torch.is_grad_enabled():
            return
        if _TOP(True) is not None:
            return  # someone else's hooks are active: do not take their saved tensors
        _autograd._push_saved_tensors_default_hooks(self._pack, self._unpack)
        self.installed = True

    def _remove(self) -> None:
        # Only when ours is on top: hooks pushed above ours (a checkpoint region entered in a parent's forward) are
        # theirs to pop; ours stay installed beneath and serve again once they are gone.
        if self.installed and _TOP is not None and _TOP(True) == (self._pack, self._unpack):
            _autograd._pop_saved_tensors_default_hooks()
            self.installed = False

    def _pack(self, tensor: torch.Tensor) -> Any:
        if self.units_open == 0:
            unit = self.owner.get(tensor.untyped_storage()._cdata)
            if unit is not None:
                return _Saved(unit, tensor)
        return tensor

    def _unpack(self, saved: Any) -> torch.Tensor:
        if type(saved) is _Saved:
            self.gather(saved.unit)
            return saved.tensor
        return saved
