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
"""

from __future__ import annotations

import torch
from torch import nn

from .. import layout
from ..comm.base import Communicator, ReduceOp
from ..placement import comm_device
from ..sharded_tensor import local

__all__ = ["ShardedGradScaler"]


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
        if isinstance(comm_or_model, nn.Module):
            model = comm_or_model
            self.groups: list[Communicator] = layout.reduction_groups(model)
        else:
            self.groups = [comm_or_model]
        self.scale_value = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.clean_steps = 0
        self.found_inf: bool | None = None  # per step: None until unscale_ ran
        self.skipped_steps = 0

    def is_enabled(self) -> bool:
        return self.enabled

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value if self.enabled else loss

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
        """Unscale (if not done) and step unless any rank found inf/nan. Returns whether the step was taken."""
        if not self.enabled:
            optimizer.step()
            return True
        self.unscale_(optimizer)
        if self.found_inf:
            self.skipped_steps += 1
            return False
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

    def get_scale(self) -> float:
        return self.scale_value if self.enabled else 1.0
