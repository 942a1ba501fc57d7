"""Dynamic loss scaling for fp16 training of sharded models (Micikevicius et al. 2018, "Mixed Precision Training").

fp16 gradients underflow unless the loss is multiplied by a large scale S before backward; the optimizer then needs
the gradients divided by S. An overflow (inf or nan) anywhere means the step must be skipped and S halved. With
sharded gradients an overflow may show up in one rank's shard only, so the "found inf" flag is all-reduced (MAX)
across the whole communicator: every rank skips the same steps and keeps the same scale. After `growth_interval`
clean steps in a row the scale doubles again.

    scaler = ShardedGradScaler(model)        # or ShardedGradScaler(comm)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)              # optional, e.g. before clip_grad_norm_
    scaler.step(opt)                  # skipped on every rank when any rank found inf/nan
    scaler.update()

State that a strategy updates while it reduces the gradients (a compressor's error-feedback residual, PowerSGD's Q)
would keep a skipped step's inf/nan for ever. Built from the model, the scaler settles that state at every `step()`
(strategies declare it as a `StepBoundState` record through the layout contract): kept when the step is taken,
restored exactly when it is skipped, on every rank alike (compression/transaction.py); and it announces each new
scale, so that such state is kept in gradient units and stays right when the scale changes. A scaler built from a
communicator does not know the model: that state is then checked at the next step and raises if not finite.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from .. import layout
from ..comm.base import Communicator, ReduceOp
from ..placement import comm_device
from ..sharded_tensor import local

__all__ = ["ShardedGradScaler", "StepBoundState"]


@dataclasses.dataclass(frozen=True, eq=False)
class StepBoundState(layout.ExtraState):
    """Extra state (layout.ExtraState) that a strategy updates during the reduction of a step's gradients, so it must
    follow that step's fate. settle(taken): called once the step is decided, before the optimizer applies it (False:
    skipped: restore the state of before the step). loss_scale(scale): the factor the coming gradients are multiplied
    by, called when it changes. Either may be None."""

    settle: Callable[[bool], None] | None = None
    loss_scale: Callable[[float], None] | None = None


class ShardedGradScaler:
    """See the module docstring.

    comm_or_model: the wrapped model (its overflow flag is then reduced over every group of its strategies: data,
    tensor and pipeline parallel alike), or a Communicator spanning every rank that holds a piece of the gradients.
    """

    def __init__(self, comm_or_model: Communicator | nn.Module, *, init_scale: float = 2.0**16,
                 growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True) -> None:
        if not isinstance(enabled, bool):
            raise ValueError(f"ShardedGradScaler: enabled={enabled!r} must be True or False")
        self.enabled = enabled  # False: every method passes through, as torch.amp.GradScaler(enabled=False)
        if not init_scale > 0:
            raise ValueError(f"ShardedGradScaler: init_scale={init_scale!r} must be positive")
        if not growth_factor > 1:
            raise ValueError(f"ShardedGradScaler: growth_factor={growth_factor!r} must be > 1")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"ShardedGradScaler: backoff_factor={backoff_factor!r} must be in (0, 1)")
        if not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"ShardedGradScaler: growth_interval={growth_interval!r} must be a positive int")
        self.model: nn.Module | None = None
        if isinstance(comm_or_model, nn.Module):
            self.model = comm_or_model
            self.groups: list[Communicator] = layout.reduction_groups(self.model)
        else:
            self.groups = [comm_or_model]
        self.scale_value = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.clean_steps = 0
        self.found_inf: bool | None = None  # per step: None until unscale_ ran
        self.skipped_steps = 0
        self._announced = 1.0  # the scale the model's step-bound state was last told (unscaled until told)

    def _bound(self) -> list[StepBoundState]:
        """The model's state that follows each step (none for a scaler built from a communicator)."""
        if self.model is None:
            return []
        return [s for s in layout.extra_states(self.model).values() if isinstance(s, StepBoundState)]

    def _settle(self, taken: bool) -> None:
        for state in self._bound():
            if state.settle is not None:
                state.settle(taken)

    def is_enabled(self) -> bool:
        return self.enabled

    def _announce(self) -> None:
        """Tell the model's step-bound state the scale of the coming gradients, when it changed."""
        if self.enabled and self.scale_value != self._announced:
            for state in self._bound():
                if state.loss_scale is not None:
                    state.loss_scale(self.scale_value)
            self._announced = self.scale_value

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return loss
        self._announce()
        return loss * self.scale_value

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide this rank's gradients by the scale and agree with every rank whether any of them overflowed.
        The overflow test stays on the gradients' device until the one agreement (a per-tensor host read would make
        the host wait for the GPU once per parameter)."""
        if self.found_inf is not None or not self.enabled:
            return
        found: torch.Tensor | None = None
        inverse = 1.0 / self.scale_value
        for group in optimizer.param_groups:
            for p in group["params"]:
                grad = local(p.grad)  # this rank's piece of a sharded gradient
                if grad is None or grad.numel() == 0:
                    continue
                grad.mul_(inverse)
                bad = torch.logical_not(torch.isfinite(grad)).any().to(torch.float32).reshape(1)
                found = bad if found is None else torch.maximum(found, bad.to(found.device))
        flag = found
        for group in self.groups:  # a skip on any rank skips on all: an OR over each group in turn
            # On the group's device (NCCL reduces CUDA tensors only), whatever device the gradients are on.
            device = comm_device(group)
            flag = torch.zeros(1, device=device) if flag is None else flag.to(device)
            group.all_reduce(flag, ReduceOp.MAX)
        self.found_inf = bool(flag.item()) if flag is not None else False

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale (if not done) and step unless any rank found inf/nan. Returns whether the step was taken.
        Settles the model's step-bound state first (restored when skipped; checked finite when taken)."""
        if not self.enabled:
            self._settle(True)
            optimizer.step()
            return True
        self.unscale_(optimizer)
        if self.found_inf:
            self.skipped_steps += 1
            self._settle(False)
            return False
        self._settle(True)
        optimizer.step()
        return True

    def update(self) -> None:
        """Back off after an overflow, grow after `growth_interval` clean steps; ready for the next step."""
        if not self.enabled:
            return
        if self.found_inf is None:
            raise RuntimeError("ShardedGradScaler.update() called before step() or unscale_()")
        if self.found_inf:
            self.scale_value *= self.backoff_factor
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps >= self.growth_interval:
                self.scale_value *= self.growth_factor
                self.clean_steps = 0
        self.found_inf = None
        self._announce()

    def get_scale(self) -> float:
        """The current scale (what `scale()` multiplies by; a pipeline's `step(loss_scale=...)` takes it)."""
        self._announce()
        return self.scale_value if self.enabled else 1.0
