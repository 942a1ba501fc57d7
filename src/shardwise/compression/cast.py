"""FP16 and BF16: all-reduce the gradient in a 16-bit float, half the bytes of fp32 (PyTorch's
`fp16_compress_hook` / `bf16_compress_hook` in torch.distributed.algorithms.ddp_comm_hooks.default_hooks).

Mechanism: each rank divides its bucket by the world size *before* the cast (so the sum cannot overflow fp16's
65504 where the fp32 average would not), casts to the 16-bit dtype, all-reduces (SUM) and casts the result back
into the bucket. No error feedback: the rounding error of one cast (relative 2^-11 for fp16, 2^-8 for bf16, per
element) is unbiased enough that training matches fp32 (Micikevicius et al. 2018); fp16 can underflow gradients
below ~6e-8 (after the division), which bf16's fp32-sized exponent cannot.

Stated error, per element: |result - average| <= (N + 1) / 2 x (eps x mean_r |g_r| + tiny): one cast and N - 1
additions in the 16-bit dtype, each within eps / 2 relative (`eps`: 2^-10 fp16, 2^-7 bf16), or tiny / 2 absolute
where the values are subnormal (`tiny`: 2^-24 fp16, 2^-133 bf16).
Bytes on the wire per bucket: one all-reduce of numel x 2 bytes: 2(N-1)/N x 2 x numel per rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import Compressor, Payload, Shapes, ring_all_reduce, total_numel

__all__ = ["FP16", "BF16"]


class _Cast(Compressor):
    dtype: torch.dtype

    def compress(self, key: str, flat: torch.Tensor, shapes: Shapes | None, world: int) -> Payload:
        half = (flat.detach() / world).to(self.dtype)
        return Payload((half,), "all_reduce")

    def decompress(self, payload: Payload, received: Sequence[torch.Tensor], out: torch.Tensor, world: int) -> None:
        out.copy_(received[0])

    def wire_bytes(self, shapes: Shapes, world: int, element_size: int = 4) -> int:
        return ring_all_reduce(total_numel(shapes), 2, world)

    def config(self) -> dict:
        return {"method": self.name}


class FP16(_Cast):
    """All-reduce gradients in float16 (2 bytes per element): see the module docstring."""

    name = "fp16"
    dtype = torch.float16
    eps = 2.0**-10  # machine epsilon: relative rounding of one cast or addition is eps / 2
    tiny = 2.0**-24  # spacing of the subnormals: absolute rounding below 2^-14


class BF16(_Cast):
    """All-reduce gradients in bfloat16 (2 bytes, fp32's exponent range): see the module docstring."""

    name = "bf16"
    dtype = torch.bfloat16
    eps = 2.0**-7
    tiny = 2.0**-133
