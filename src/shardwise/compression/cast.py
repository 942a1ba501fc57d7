"""FP16 and BF16: all-reduce the gradient in a 16-bit float, half the bytes of fp32 (PyTorch's
`fp16_compress_hook` / `bf16_compress_hook` in torch.distributed.algorithms.ddp_comm_hooks.default_hooks).

Mechanism: each rank divides its bucket by the world size *before* the cast (so the sum cannot overflow fp16's
65504 where the fp32 average would not), casts to the 16-bit dtype, all-reduces (SUM) and casts the result back
into the bucket. By default no error feedback, as torch's hooks: the rounding error of one cast (relative 2^-11
for fp16, 2^-8 for bf16, per element) is unbiased, and the 200-step measurement (docs/compression.md) found error
feedback changes the final loss by less than one seed's noise (bf16 +5.2% instead of +5.6% against fp32, fp16
-0.1% instead of -0.2%) for a full fp32 gradient copy per rank; fp16 can underflow gradients below ~6e-8 (after the
division), which bf16's fp32-sized exponent cannot, and which error feedback carries until they are not.

Stated error, per element: |result - average| <= (N + 1) / 2 x (eps x mean_r |g_r| + tiny): one cast and N - 1
additions in the 16-bit dtype, each within eps / 2 relative (`eps`: 2^-10 fp16, 2^-7 bf16), or tiny / 2 absolute
where the values are subnormal (`tiny`: 2^-24 fp16, 2^-133 bf16).
Bytes on the wire per bucket: one all-reduce of numel x 2 bytes: 2(N-1)/N x 2 x numel per rank.

`error_feedback=True` (the memory of the sparse methods, Seide et al. 2014; Karimireddy et al. 2019, applied to the
rounding): each rank keeps, per bucket, the fp32 residual of its last cast, e, and sends cast((g + e) / N); the new
residual is e' = (g + e) - N x cast((g + e) / N). So sum over steps of what a rank sent = sum of its gradients - e',
and e' stays within one cast's rounding (|e'| <= eps / 2 x |g + e|): the rounding no longer adds up over steps, and
a gradient too small for fp16 (flushed to zero) is carried until it is not. What it does not cover: the N - 1
16-bit additions inside the all-reduce (done on the wire, not on this rank), so one step's result keeps the error
bound above; what improves is the sum over steps. Costs: one fp32 tensor per bucket per rank (saved in checkpoints),
no extra bytes on the wire.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import Compressor, Payload, Shapes, ring_all_reduce, total_numel

__all__ = ["FP16", "BF16"]


class _Cast(Compressor):
    """A cast to `dtype` before a summing all-reduce; `error_feedback`: keep each rank's rounding residual."""

    dtype: torch.dtype

    def __init__(self, error_feedback: bool = False) -> None:
        super().__init__()
        if not isinstance(error_feedback, bool):
            raise ValueError(f"{type(self).__name__}: error_feedback={error_feedback!r} must be True or False")
        self.error_feedback = error_feedback

    def compress(self, key: str, flat: torch.Tensor, shapes: Shapes | None, world: int) -> Payload:
        if not self.error_feedback:
            return Payload(((flat.detach() / world).to(self.dtype),), "all_reduce")
        # The residual is kept in fp32 and in gradient units (not divided by N): a 16-bit bucket's residual would
        # itself be rounded away, and gradient units make "sent + memory = gradients" read as for the other methods.
        acc = flat.detach().to(torch.float32, copy=True)  # a copy even for fp32: the bucket receives the result
        residual = self.memory.get(key)
        if residual is not None:
            if residual.shape != acc.shape:
                raise ValueError(f"{self.name}: bucket {key!r} has {acc.numel()} elements but its error-feedback "
                                 f"memory {residual.numel()}: the model's buckets changed after a resume")
            acc += residual
        half = (acc / world).to(self.dtype)
        self.memory[key] = acc.sub_(half.float(), alpha=world)  # in place: acc is this step's own tensor
        return Payload((half,), "all_reduce")

    def decompress(self, payload: Payload, received: Sequence[torch.Tensor], out: torch.Tensor, world: int) -> None:
        out.copy_(received[0])

    def wire_bytes(self, shapes: Shapes, world: int, element_size: int = 4) -> int:
        return ring_all_reduce(total_numel(shapes), 2, world)

    def config(self) -> dict:
        # error_feedback appears only when on, so checkpoints of the plain cast (no state) keep their config.
        return {"method": self.name, **({"error_feedback": True} if self.error_feedback else {})}


class FP16(_Cast):
    """All-reduce gradients in float16 (2 bytes per element): see the module docstring.

    error_feedback: keep each rank's rounding residual per bucket and add it to the next gradient (fp32 memory the
        size of the gradients; the default is measured in docs/compression.md).
    """

    name = "fp16"
    dtype = torch.float16
    eps = 2.0**-10  # machine epsilon: relative rounding of one cast or addition is eps / 2
    tiny = 2.0**-24  # spacing of the subnormals: absolute rounding below 2^-14


class BF16(_Cast):
    """All-reduce gradients in bfloat16 (2 bytes, fp32's exponent range): see the module docstring.

    error_feedback: as FP16's.
    """

    name = "bf16"
    dtype = torch.bfloat16
    eps = 2.0**-7
    tiny = 2.0**-133
