"""`estimate_memory`: the model-state memory of each strategy before anything runs (ZeRO paper, section 3-5).

With Ψ parameters, N data-parallel ranks and mixed-precision Adam (Rajbhandari et al. 2020): fp16/bf16 parameters
(2Ψ bytes) and gradients (2Ψ), and K = 12 bytes of optimizer state per parameter (fp32 master copy, momentum,
variance). Per rank:

    DDP / no_shard            (2 + 2 + K) Ψ            = 16Ψ
    ZeRO-1 (P_os)             2Ψ + 2Ψ + KΨ/N           = 4Ψ + 12Ψ/N
    ZeRO-2 (P_os+g)           2Ψ + (2 + K)Ψ/N          = 2Ψ + 14Ψ/N
    ZeRO-3 / full_shard       (2 + 2 + K)Ψ/N           = 16Ψ/N

In fp32 (no mixed precision) parameters and gradients take 4 bytes and Adam K = 8 (momentum and variance; the
parameters are their own master copy). The paper's Figure 1 (Ψ = 7.5B, N = 64) gives 120, 31.4, 16.6 and 1.9 GB.
Activations and temporary buffers are not included: they depend on batch, sequence and checkpointing.
"""

from __future__ import annotations

import dataclasses

from torch import nn

__all__ = ["MemoryEstimate", "estimate_memory", "STRATEGIES"]

# strategy -> which of (params, grads, optimizer state) are divided by N
STRATEGIES = {
    "ddp": (False, False, False),
    "no_shard": (False, False, False),
    "zero1": (False, False, True),
    "zero2": (False, True, True),
    "shard_grad_op": (False, True, True),
    "zero3": (True, True, True),
    "full_shard": (True, True, True),
}
# optimizer -> bytes of state per parameter beyond the parameter itself, (mixed precision, fp32)
OPTIMIZER_BYTES = {"adamw": (12, 8), "adam": (12, 8), "sgd_momentum": (8, 4), "sgd": (4, 0)}


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank bytes of model states for one strategy (see the module docstring for the formulas)."""

    strategy: str
    world_size: int
    num_params: int
    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total_gb(self) -> float:
        """Total in GB of 10^9 bytes, the unit of the ZeRO paper."""
        return self.total / 1e9


def estimate_memory(
    model_or_num_params: nn.Module | int,
    strategy: str = "zero3",
    world_size: int = 1,
    *,
    optimizer: str = "adamw",
    mixed_precision: bool = True,
) -> MemoryEstimate:
    """Model-state bytes per rank of `strategy` over `world_size` ranks (ZeRO paper formulas).

    model_or_num_params: a module (its unique parameters are counted) or a parameter count Ψ.
    strategy: one of STRATEGIES. optimizer: one of OPTIMIZER_BYTES. mixed_precision: 16-bit parameters and
    gradients with an fp32 master copy in the optimizer state (True), or everything in fp32 (False).
    """
    if isinstance(model_or_num_params, nn.Module):
        psi = sum(p.numel() for p in model_or_num_params.parameters())
    elif isinstance(model_or_num_params, int) and not isinstance(model_or_num_params, bool) and model_or_num_params > 0:
        psi = model_or_num_params
    else:
        raise ValueError(f"estimate_memory: {model_or_num_params!r} is neither a module nor a positive parameter count")
    if strategy not in STRATEGIES:
        raise ValueError(f"estimate_memory: strategy={strategy!r} is not known; allowed {sorted(STRATEGIES)}")
    if optimizer not in OPTIMIZER_BYTES:
        raise ValueError(f"estimate_memory: optimizer={optimizer!r} is not known; allowed {sorted(OPTIMIZER_BYTES)}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"estimate_memory: world_size={world_size!r} must be a positive int")
    width = 2 if mixed_precision else 4
    k = OPTIMIZER_BYTES[optimizer][0 if mixed_precision else 1]
    shard_p, shard_g, shard_o = STRATEGIES[strategy]
    n = world_size
    return MemoryEstimate(
        strategy=strategy,
        world_size=n,
        num_params=psi,
        params=width * psi / (n if shard_p else 1),
        grads=width * psi / (n if shard_g else 1),
        optimizer=k * psi / (n if shard_o else 1),
    )
