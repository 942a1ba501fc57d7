"""Stochastic rounding of float32 to bfloat16: each value goes to one of its two bf16 neighbours at random, up with
probability equal to the fraction of a bf16 step that rounding down would drop, so E[result] = x exactly.

Mechanism: bfloat16 is the upper 16 bits of a float32. Adding a uniform random integer in [0, 2^16) to the float32's
bit pattern (read as an int32) carries into bit 16 exactly when the random number is at least 2^16 minus the
dropped low half; truncating the low 16 bits then leaves the rounded-up value with that probability and the
rounded-down one otherwise. On the sign-magnitude pattern this is the same for negative values (it moves the
magnitude), and infinities and the usual NaNs keep their patterns (their low 16 bits are zero). Exotic NaN
payloads near the top of the int32 range could wrap, so where the input holds a non-finite value those values are
passed through a plain cast.

Why: round to nearest is unbiased only on average over values; one value rounded the same way every step (a
gradient coordinate that changes slowly) keeps the same error every step. Stochastic rounding turns that into
zero-mean noise, the remedy for bf16's 8-bit significand in training (Gupta et al. 2015, "Deep Learning with
Limited Numerical Precision"; Zamirai et al. 2020, "Revisiting BFloat16 Training"). Error per value: below one
bf16 step (2^-7 relative), against half a step for round to nearest, but without bias.

Cost: one random 16-bit number per value. The generator's 32-bit draws are split into two 16-bit halves, so half
as many draws as values.
"""

from __future__ import annotations

import torch

__all__ = ["stochastic_round_bf16"]

_LOW_HALF = 0xFFFF
_HIGH_HALF = -0x10000  # int32 mask that keeps the upper 16 bits


def stochastic_round_bf16(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """`x` (float32, 1-D) rounded to bfloat16 stochastically with `generator` (on x's device); a new tensor."""
    if x.dtype != torch.float32:
        raise ValueError(f"stochastic_round_bf16: expects float32, got {x.dtype}")
    n = x.numel()
    draws = torch.randint(-2**31, 2**31, ((n + 1) // 2,), dtype=torch.int32, device=x.device, generator=generator)
    noise = draws.view(torch.int16)[:n].to(torch.int32).bitwise_and_(_LOW_HALF)  # n uniform values in [0, 2^16)
    bits = noise.add_(x.contiguous().view(torch.int32)).bitwise_and_(_HIGH_HALF)
    rounded = bits.view(torch.float32).to(torch.bfloat16)  # exact: the low 16 bits are zero
    # A sum is one cheap pass (isfinite(x).all() is ~10x slower on CPU) and is non-finite if any value is; a sum that
    # overflows from finite values only sends us down the exact path below.
    if not bool(torch.isfinite(x.sum())):
        rounded = torch.where(torch.isfinite(x), rounded, x.to(torch.bfloat16))
    return rounded
