"""OneBitAdam: Adam whose data-parallel exchange is 1-bit compressed momentum after a warm-up (Tang et al., "1-bit
Adam: Communication Efficient Large-Scale Training with Adam's Convergence Speed", ICML 2021, arXiv 2102.02888).

Why not simply compress Adam's gradients: Adam's update divides by sqrt(v), a nonlinear function of the gradient,
so the error that error feedback carries over is distorted and training diverges. The paper observes that v
stabilises early; after it is frozen, Adam is a momentum SGD with a fixed per-coordinate learning rate, which is
linear in the momentum, so the momentum can be compressed with error feedback like SGD's gradients.

Mechanism (the optimizer does the communication itself: use it on a model that is *not* wrapped in DDP, whose
replicas it makes equal at construction by broadcasting rank 0's parameters):
* warm-up, steps 1..freeze_step: the gradients are all-reduced (fp32 average) and the step is exactly Adam's
  (torch.optim.Adam with bias correction, decoupled weight decay as AdamW when weight_decay > 0);
* compression stage, later steps: v is frozen (as is its bias correction); each rank updates its momentum with its
  *local* gradient, m = beta1 m + (1 - beta1) g_local; the momenta of all parameters are exchanged in one
  compressed all-reduce (by default `OneBit(scale="rms")`: signs + one root-mean-square scale per tensor, as
  DeepSpeed's 1-bit Adam scales them, with error feedback on each rank; over five seeds of the demo GPT it ended
  +2.4% from AdamW on average against +3.4% with the l1 scale, docs/compression.md), and
  every rank continues from the same averaged momentum; x -= lr x m_hat / (sqrt(v_hat) + eps).
The paper's two-stage (worker + server error) exchange is replaced by OneBit's all-gather of bits and scales (same
error-feedback guarantee; (N-1)/8 bytes per element per rank instead of ~2/8: see onebit.py).

State: the Adam moments (per parameter, in `state_dict()["state"]`, as torch's Adam keeps them) and the
compressor's error feedback (`state_dict()["compressor"]`), so a resumed run continues exactly; `sw.save_checkpoint`
saves the step count and the per-rank error feedback too (`extra_state()`).

Non-finite values: a step skipped by a loss scaler (`sw.ShardedGradScaler(comm)`: every rank skips when any found an
inf/nan) never calls `step()`, so nothing changes. A step taken with gradients that are not finite raises
NonFiniteStateError naming the parameter, checked on what every rank agrees on (the averaged gradient during the
warm-up: before the moments change; the averaged momentum after: the error feedback is restored), one host read per
step, so every rank raises at the same step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..comm.base import Communicator, ReduceOp, is_communicator
from ..comm.coalesced import broadcast_coalesced
from ..sharded_tensor import local
from .base import Compressor
from .onebit import OneBit
from .transaction import NonFiniteStateError, first_nonfinite

__all__ = ["OneBitAdam"]


class OneBitAdam(torch.optim.Optimizer):
    """1-bit Adam over `comm` (see the module docstring).

    params: the (replicated, unwrapped) model's parameters. comm: the data-parallel communicator.
    lr, betas, eps, weight_decay: as torch.optim.AdamW (weight_decay=0: as Adam).
    freeze_step: steps of full-precision Adam before the variance is frozen and momentum is compressed (the
        paper: ~15-25% of training; too early and the frozen variance is a poor preconditioner).
    compressor: the momentum's compression (default OneBit(scale="rms"); any sw.compression method with error
        feedback).
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict], comm: Communicator, *, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 freeze_step: int = 100, compressor: Compressor | None = None) -> None:
        if not is_communicator(comm):
            raise ValueError(f"OneBitAdam: comm must be a shardwise Communicator, got {type(comm).__name__}")
        if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
            raise ValueError(f"OneBitAdam: freeze_step={freeze_step!r} must be an int >= 1 (steps of Adam warm-up "
                             f"before the variance is frozen)")
        if not (isinstance(betas, tuple) and len(betas) == 2 and all(0 <= b < 1 for b in betas)):
            raise ValueError(f"OneBitAdam: betas={betas!r} must be two numbers in [0, 1)")
        for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"OneBitAdam: {name}={value!r} must be a number >= 0")
        if compressor is not None and not isinstance(compressor, Compressor):
            raise ValueError(f"OneBitAdam: compressor={compressor!r} must be a sw.compression method or None "
                             f"(OneBit(scale='rms'))")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.comm = comm
        self.freeze_step = freeze_step
        self.compressor = (compressor or OneBit(scale="rms")).fresh()
        self.steps = 0
        if comm.size > 1:  # every replica starts from rank 0's values
            broadcast_coalesced(comm, [local(p.data) for group in self.param_groups for p in group["params"]])

    def _trainable(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.steps += 1
        params = self._trainable()
        groups = {id(p): group for group in self.param_groups for p in group["params"]}
        # Every rank must contribute every parameter, in the same order: a missing gradient counts as zeros.
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        warm = self.steps <= self.freeze_step
        if warm:
            if self.comm.size > 1:
                flat = torch.cat([g.reshape(-1) for g in grads])
                self.comm.all_reduce(flat, ReduceOp.AVG)
                grads = _unflatten(flat, params)
            # The averaged gradient, the same on every rank (so is the verdict): one sum, one host read.
            bad = first_nonfinite([flat] if self.comm.size > 1 else grads)
            bad = bad if bad is None or self.comm.size == 1 else first_nonfinite(grads)  # which parameter
            if bad is not None:
                message = self._message("averaged gradient", bad, params)
                self.steps -= 1  # refused: the step count and the moments are as they were
                raise NonFiniteStateError(message + "; the step is refused and the moments are as they were. Skip "
                                          "steps whose gradients are not finite: sw.ShardedGradScaler(comm)")
        for p, g in zip(params, grads):
            state = self.state[p]
            if not state:
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            beta1, beta2 = groups[id(p)]["betas"]
            state["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
            if warm:
                state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
        if not warm:
            momenta = [self.state[p]["exp_avg"] for p in params]
            flat = torch.cat([m.reshape(-1) for m in momenta])
            self.compressor.reduce("momentum", flat, self.comm, [p.shape for p in params]).wait()
            averaged = _unflatten(flat, params)
            # One host read checks the averaged momentum (the same on every rank) and the error feedback.
            self.compressor.settle(True, [(m, lambda count, i=i: self._message(
                "momentum (exp_avg)", (i, count), params) + "; its error feedback is as before this step. Skip "
                "steps whose gradients are not finite: sw.ShardedGradScaler(comm)") for i, m in enumerate(averaged)])
            for m, avg in zip(momenta, averaged):
                m.copy_(avg)
        variance_steps = min(self.steps, self.freeze_step)
        for p in params:
            group, state = groups[id(p)], self.state[p]
            beta1, beta2 = group["betas"]
            if group["weight_decay"]:
                p.mul_(1 - group["lr"] * group["weight_decay"])
            m_hat = state["exp_avg"] / (1 - beta1**self.steps)
            v_hat = state["exp_avg_sq"] / (1 - beta2**variance_steps)
            p.addcdiv_(m_hat, v_hat.sqrt().add_(group["eps"]), value=-group["lr"])
        return loss

    def _message(self, what: str, bad: tuple[int, int], params: list[torch.Tensor]) -> str:
        index, count = bad
        return (f"OneBitAdam's {what} of parameter {index} (shape {tuple(params[index].shape)}) holds {count} "
                f"non-finite values after step {self.steps}")

    @property
    def frozen(self) -> bool:
        """Whether the variance is frozen (the compression stage has begun)."""
        return self.steps >= self.freeze_step

    def extra_state(self) -> tuple[Any, ...]:
        """What `sw.save_checkpoint` saves besides the per-parameter moments (layout.ExtraState records): the step
        count, equal on every rank ("onebit_adam", replicated, valid under the same freeze_step), and the momentum
        compressor's error feedback, each rank's own ("onebit_adam_compressor", per rank)."""
        from ..layout import ExtraState

        def check(state: dict[str, Any]) -> None:
            steps = state.get("steps")
            if set(state) != {"steps"} or isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
                raise ValueError(f"OneBitAdam: the state must be {{'steps': a non-negative int}}, got {state!r}")

        def load(state: dict[str, Any]) -> None:
            self.steps = int(state["steps"])

        return (ExtraState("onebit_adam", "replicated", lambda: {"steps": self.steps}, load, check,
                           config={"freeze_step": self.freeze_step}, group=self.comm),
                dataclasses.replace(self.compressor.extra_state(self.comm, follows_gradients=False),
                                    name="onebit_adam_compressor"))

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["onebit"] = {"steps": self.steps, "freeze_step": self.freeze_step,
                           "compressor": self.compressor.state_dict()}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("onebit", None)
        if extra is None:
            raise ValueError("OneBitAdam.load_state_dict: the state has no 'onebit' entry (step count and error "
                             "feedback); it was not saved by OneBitAdam.state_dict()")
        super().load_state_dict(state_dict)
        self.steps = int(extra["steps"])
        self.compressor.load_state_dict(extra["compressor"])


def _unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for p in like:
        out.append(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    return out
