"""Refuse a `requires_grad` change after wrapping, for strategies whose set of trained parameters is fixed then.

DDP, ZeRO, FSDP and `sw.parallelize` follow a script that freezes or unfreezes parameters between steps
(sharding/trainable.py, ddp_reducer.py). Local SGD, DiLoCo, Streaming DiLoCo and the parameter server choose at wrap
time which parameters they average or serve, and keep anchors and outer-optimizer state for exactly those: a
parameter unfrozen later would train on each replica alone and drift apart silently, one frozen later would still be
moved by the outer optimizer's momentum. They call `check` once per inner step (a read of one flag per parameter)
and raise, naming the parameters, before anything is averaged.
"""

from __future__ import annotations

from torch import nn

__all__ = ["RequiresGradAtWrap"]


class RequiresGradAtWrap:
    """The `requires_grad` of every parameter of a module when a strategy wrapped it (module docstring)."""

    def __init__(self, module: nn.Module) -> None:
        self.named = list(module.named_parameters())
        self.flags = [p.requires_grad for _, p in self.named]

    def check(self, who: str) -> None:
        """ValueError naming the parameters whose `requires_grad` changed since wrapping, if any."""
        if all(p.requires_grad is flag for (_, p), flag in zip(self.named, self.flags)):
            return
        changed = [f"{name} ({flag} -> {p.requires_grad})" for (name, p), flag in zip(self.named, self.flags)
                   if p.requires_grad is not flag]
        raise ValueError(f"{who}: requires_grad of {changed[:8]}{' ...' if len(changed) > 8 else ''} changed after "
                         f"wrapping; {who} synchronises the parameters that required grad when it wrapped the model "
                         f"(with their anchors and outer-optimizer state): set requires_grad before wrapping (sw.DDP, "
                         f"sw.ZeRO, sw.FSDP and sw.parallelize follow a change between steps)")
