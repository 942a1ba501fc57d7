"""FP16 and BF16: all-reduce the gradient in a 16-bit float, half the bytes of fp32 (PyTorch's
`fp16_compress_hook` / `bf16_compress_hook` in torch.distributed.algorithms.ddp_comm_hooks.default_hooks).

Mechanism: each rank divides its bucket by the world size *before* the cast (so the sum cannot overflow fp16's
65504 where the fp32 average would not), casts to the 16-bit dtype, all-reduces (SUM) and casts the result back
into the bucket. FP16 rounds to nearest, as torch's hooks. BF16 rounds **stochastically** by default
(`rounding="stochastic"`, compression/rounding.py: up or down at random, unbiased), because bf16's 8-bit
significand rounded to nearest cost the demo GPT +2.6% of final loss on average over three seeds under AdamW (one
seed +5.6%; torch's `bf16_compress_hook` the same to the last digit), where stochastic rounding averages +0.2% over
the same seeds (single runs still spread by about +-2% on a seed whose training has a sharp transition:
docs/compression.md). Round to nearest makes the same error every step for a coordinate whose gradient changes
slowly, and those errors add up along the trajectory; stochastic rounding makes them zero-mean noise. Each rank
draws from its own generator, seeded by (seed, bucket, step, rank), so runs and resumes repeat bit for bit.
`BF16(rounding="nearest")` is torch's hook. No error feedback by default: it did not rescue bf16 rounded to nearest
(+5.2% instead of +5.6% on that seed) and costs a full fp32 gradient copy per rank; fp16 can underflow gradients
below ~6e-8 (after the division), which bf16's fp32-sized exponent cannot, and which error feedback carries until
they are not.

Stated error, per element: |result - average| <= (N + 1) / 2 x (eps x mean_r |g_r| + tiny): one cast (within eps / 2
relative rounding to nearest, eps stochastically) and N - 1 additions in the 16-bit dtype on the wire, each within
eps / 2 relative (`eps`: 2^-10 fp16, 2^-7 bf16), or tiny / 2 absolute where the values are subnormal (`tiny`:
2^-24 fp16, 2^-133 bf16).
Bytes on the wire per bucket: one all-reduce of numel x 2 bytes: 2(N-1)/N x 2 x numel per rank.

In ZeRO and FSDP (every stage) the same cast feeds a 16-bit **reduce-scatter** instead (`reduce_scatter`:
(N-1)/N x 2 x numel per rank, the bytes of MixedPrecision(reduce_dtype=...), which rounds to nearest): each rank
keeps only its chunk of the average, and the stated error per element is the same, with one cast and N - 1 additions.

`error_feedback=True` (the memory of the sparse methods, Seide et al. 2014; Karimireddy et al. 2019, applied to the
rounding): each rank keeps, per bucket, the fp32 residual of its last cast, e, and sends cast((g + e) / N); the new
residual is e' = (g + e) - N x cast((g + e) / N). So sum over steps of what a rank sent = sum of its gradients - e',
and e' stays within one cast's rounding (|e'| <= eps / 2 x |g + e| to nearest, eps x |g + e| stochastically): the
rounding no longer adds up over steps, and a gradient too small for fp16 (flushed to zero) is carried until it is
not. What it does not cover: the N - 1 16-bit additions inside the all-reduce (done on the wire, not on this rank),
so one step's result keeps the error bound above; what improves is the sum over steps. Costs: one fp32 tensor per
bucket per rank (saved in checkpoints), no extra bytes on the wire.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from ..comm.base import Communicator, ReduceOp, Work, wire_bytes
from .base import Compressor, Payload, PendingWork, Shapes, ring_all_reduce, shared_generator, total_numel
from .rounding import stochastic_round_bf16

__all__ = ["FP16", "BF16"]


class _Cast(Compressor):
    """A cast to `dtype` before a summing all-reduce; `error_feedback`: keep each rank's rounding residual."""

    dtype: torch.dtype

    def __init__(self, error_feedback: bool = False) -> None:
        super().__init__()
        if not isinstance(error_feedback, bool):
            raise ValueError(f"{type(self).__name__}: error_feedback={error_feedback!r} must be True or False")
        self.error_feedback = error_feedback

    def _cast(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """`x` (this rank's share, already divided by N) in the 16-bit dtype: round to nearest here."""
        return x.to(self.dtype)

    def compress(self, key: str, flat: torch.Tensor, shapes: Shapes | None, world: int) -> Payload:
        if not self.error_feedback:
            return Payload((self._cast(key, flat.detach().float() / world),), "all_reduce")
        # The residual is kept in fp32 and in gradient units (not divided by N): a 16-bit bucket's residual would
        # itself be rounded away, and gradient units make "sent + memory = gradients" read as for the other methods.
        acc = flat.detach().to(torch.float32, copy=True)  # a copy even for fp32: the bucket receives the result
        residual = self.memory.get(key)
        if residual is not None:
            if residual.shape != acc.shape:
                raise ValueError(f"{self.name}: bucket {key!r} has {acc.numel()} elements but its error-feedback "
                                 f"memory {residual.numel()}: the model's buckets changed after a resume")
            acc.add_(residual, alpha=self.loss_scale)  # kept in gradient units
        half = self._cast(key, acc / world)
        # In place: acc is this step's own tensor, which becomes the new residual (the old one stays untouched until
        # the step is settled). A non-finite acc is in `half` too, so every rank's result shows it.
        self._stage("memory", key, acc.sub_(half.float(), alpha=world), scaled=True)
        return Payload((half,), "all_reduce")

    def decompress(self, payload: Payload, received: Sequence[torch.Tensor], out: torch.Tensor, world: int) -> None:
        out.copy_(received[0])

    def wire_bytes(self, shapes: Shapes, world: int, element_size: int = 4) -> int:
        return ring_all_reduce(total_numel(shapes), 2, world)

    # ---- ZeRO / FSDP: the same cast, reduce-scattered ---------------------------------------------------------
    reduces_scatter = True

    @property
    def keeps_flags(self) -> bool:  # a cast keeps 0 zero and 1/N positive; error feedback would add residuals
        return not self.error_feedback

    def reduce_scatter(self, key: Hashable, flat: torch.Tensor, out: torch.Tensor, comm: Communicator) -> Work:
        """The cast of `compress` (this rank's share, divided by N first, in the method's rounding, with its error
        feedback), then one reduce-scatter (SUM) in 16 bits: `out` receives this rank's chunk of the average. The
        sharding engine's replacement for MixedPrecision(reduce_dtype=...), which rounds to nearest."""
        self._check_bucket(flat)
        if flat.numel() != out.numel() * comm.size:
            raise ValueError(f"{self.name}.reduce_scatter: {flat.numel()} elements do not split into {comm.size} "
                             f"chunks of {out.numel()}")
        key = str(key)
        self._warming_up(key)  # counts the reduction (the stochastic rounding's stream); casts have no warm-up
        self.comm_rank = comm.rank
        (half,) = self.compress(key, flat, None, comm.size).tensors
        chunk = torch.empty(out.numel(), dtype=self.dtype, device=out.device)
        work = comm.reduce_scatter(chunk, half, ReduceOp.SUM, async_op=True, scratch_input=True)

        def finish() -> None:
            out.copy_(chunk)
            self._observe(key, [chunk])  # this rank's chunk only: it sees another rank's NaN that lands in it

        return PendingWork([work], finish)

    def wire_bytes_reduce_scatter(self, numel: int, world: int) -> int:
        """Per-rank ring bytes of `reduce_scatter` of a `numel`-element buffer: (N-1)/N x 2 numel."""
        return wire_bytes("reduce_scatter", numel * 2, world)

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
    rounding: "stochastic" (the default): each rank rounds its share up or down at random, unbiased
        (compression/rounding.py), from a generator seeded by (seed, bucket, step, rank), so runs and resumes
        repeat; "nearest": round to nearest even, torch's `bf16_compress_hook`. The measurement that chose the
        default is in docs/compression.md (200 steps of the demo GPT under AdamW: nearest +2.6% on average over
        three seeds against fp32, stochastic +0.2%). Costs one random 16-bit number per element.
    seed: the stochastic rounding's seed (ranks draw different numbers from it).
    """

    name = "bf16"
    dtype = torch.bfloat16
    eps = 2.0**-7
    tiny = 2.0**-133
    ROUNDINGS = ("stochastic", "nearest")

    def __init__(self, error_feedback: bool = False, rounding: str = "stochastic", seed: int = 0) -> None:
        super().__init__(error_feedback)
        if rounding not in self.ROUNDINGS:
            raise ValueError(f"BF16: rounding={rounding!r}; allowed {list(self.ROUNDINGS)}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"BF16: seed={seed!r} must be an int")
        self.rounding = rounding
        self.seed = seed

    def _cast(self, key: str, x: torch.Tensor) -> torch.Tensor:
        if self.rounding == "nearest":
            return super()._cast(key, x)
        generator = shared_generator(self.seed, f"{key}/rank{self.comm_rank}", self.iterations[key], x.device)
        return stochastic_round_bf16(x.float(), generator)

    def config(self) -> dict:
        # The rounding is always named (checkpoints of the two roundings are not interchangeable: the results
        # differ); the seed only when set, as error_feedback.
        extra = {"rounding": self.rounding, **({"seed": self.seed} if self.seed else {})}
        return {**super().config(), **extra}
