"""OneBit: each rank sends the sign of every element (1 bit) and one scale per tensor, with error feedback
(Seide et al., "1-Bit Stochastic Gradient Descent", Interspeech 2014; the scaled sign of Karimireddy et al.,
"Error Feedback Fixes SignSGD and other Gradient Compression Schemes", ICML 2019).

Mechanism, per bucket and step on each rank:
1. acc = gradient + memory;
2. for each tensor j of the bucket, scale_j = ||acc_j||_1 / numel_j (the scale that minimises the error of
   scale x sign(acc_j) in the l1 sense and makes the compressor a delta-approximation: EF-signSGD's C(x));
   compressed = scale_j x sign(acc_j) (sign(0) counts as +1); memory = acc - compressed;
3. signs are packed 8 per byte; one **all-gather** exchanges every rank's bits and scales (signs cannot be summed
   in 1 bit, so a ring all-reduce is not possible); each rank unpacks N sign vectors and averages
   scale_r,j x sign_r. 1-bit Adam's two-stage exchange (compress again after a reduce-scatter, with a second,
   server-side error) would make the volume independent of N; with an all-gather it is (N-1) x numel / 8 bytes,
   cheaper than an fp32 all-reduce (8 (N-1)/N x numel) while N < 64.

`scale="rms"` uses ||acc_j||_2 / sqrt(numel_j), the root mean square, instead: DeepSpeed's 1-bit Adam compresses its
momentum with it (its `compressed_allreduce`). It is at least the l1 scale (Cauchy-Schwarz), so each step sends a
tensor's large coordinates faster and overshoots its small ones, which error feedback carries back. With 1-bit Adam
on the demo GPT it closed more of the gap to uncompressed AdamW than the l1 scale (docs/compression.md), which is
why `OneBitAdam` uses it by default; for plain gradients the default stays EF-signSGD's l1.

`block_size=B` gives each run of B elements of a tensor its own scale (1-bit SGD's finer reconstruction values,
Seide et al. 2014, use one per column). Why it matters: with one scale per tensor a coordinate whose gradient is
consistently far above the tensor's mean magnitude is sent at most mean |acc| per step, so its memory grows until
the backlog is hundreds of its gradients (measured on the tiny GPT under momentum SGD: the largest memory entry
200-330x the largest gradient entry, against 2-6x with B = 64), and arrives late and in lumps; the delta of
Karimireddy et al.'s bound, ||acc||_1^2 / (numel ||acc||^2), is that small for heavy-tailed tensors. Blocks bound
the max / mean ratio inside each run by B. Cost: 4 / B bytes more per element (B = 64: 1.5x the bits alone).

Stated error: each rank's contribution differs from its acc by exactly its new memory (so the sum over steps of
what it sent = sum of its gradients - memory); with the l1 scale ||acc_j - compressed_j||^2 <= (1 - 1/numel_j)
||acc_j||^2 keeps the memory bounded for bounded gradients (Karimireddy et al., Theorem 1); with the rms scale the
error is 2 ||acc_j||^2 (1 - ||acc_j||_1 / (sqrt(numel_j) ||acc_j||_2)), below ||acc_j||^2 unless the tensor is
heavy-tailed (l1 / (sqrt(n) l2) < 1/2), where it is not a contraction: the property test checks it in practice.
Bytes on the wire per bucket: all-gather of ceil(numel / 8) bytes + all-gather of T x 4 bytes of scales (T tensors,
or T runs with block_size): (N-1) x (ceil(numel / 8) + 4T) per rank.

Under Adam: pass `start_iter=20`-ish and give the optimizer `betas=(0.3, 0.999)`: error feedback's delayed sums are a
momentum of their own, which Adam's default beta1 0.9 compounds. On the demo GPT that brought OneBit() from +36.5%
(beta1 0.9, no warm-up) to within 3% of uncompressed AdamW on five seeds of five (docs/compression.md, "Delay").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import Compressor, Payload, Shapes, check_start_iter, ring_all_gather, tile, total_numel, with_start_iter

__all__ = ["OneBit", "pack_signs", "unpack_signs"]

_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
_SHIFTS = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.uint8)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """ceil(numel / 8) uint8: bit 1 where x >= 0, most significant bit first; the tail is padded with ones."""
    bits = x.reshape(-1) >= 0
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat([bits, bits.new_ones(pad)])
    weights = _WEIGHTS.to(x.device)
    return (bits.view(-1, 8).to(torch.uint8) * weights).sum(1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The +1 / -1 values pack_signs encoded, for the last dimension of `packed` (...: rows of packed bytes)."""
    shifts = _SHIFTS.to(packed.device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1
    bits = bits.reshape(*packed.shape[:-1], -1)[..., :numel]
    return bits.to(dtype) * 2 - 1


class OneBit(Compressor):
    """Sign + per-tensor (or per-block) scale with error feedback (see the module docstring).

    block_size: None (default): one scale per tensor, EF-signSGD's; an int B >= 1: one scale per run of B elements
        of each tensor (the last run of a tensor may be shorter), 4 / B more bytes per element on the wire.
    scale: "l1" (default): mean |x| of the run, EF-signSGD's; "rms": its root mean square, DeepSpeed's 1-bit Adam's.
    start_iter: the first reductions of each bucket done exactly (fp32 all-reduce) before sending signs.
    """

    name = "onebit"
    SCALES = ("l1", "rms")

    def __init__(self, block_size: int | None = None, scale: str = "l1", start_iter: int = 0) -> None:
        super().__init__()
        self.start_iter = check_start_iter("OneBit", start_iter)
        if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int)
                                       or block_size < 1):
            raise ValueError(f"OneBit: block_size={block_size!r} must be None (one scale per tensor) or an int >= 1 "
                             f"(one scale per that many elements)")
        if scale not in self.SCALES:
            raise ValueError(f"OneBit: scale={scale!r}; allowed {list(self.SCALES)}")
        self.block_size = block_size
        self.scale = scale

    def config(self) -> dict:
        # block_size and scale appear only when not the defaults, so checkpoints of the per-tensor l1 method keep
        # their config.
        return with_start_iter({"method": self.name,
                                **({"block_size": self.block_size} if self.block_size is not None else {}),
                                **({"scale": self.scale} if self.scale != "l1" else {})}, self.start_iter)

    def _counts(self, shapes: Shapes | None, numel: int) -> list[int]:
        """The element count of every run that gets its own scale, in bucket order."""
        counts = [shape.numel() for _, shape in tile(shapes, numel)]
        if self.block_size is None:
            return counts
        b = self.block_size
        return [min(b, c - start) for c in counts for start in range(0, c, b)]

    def compress(self, key: str, flat: torch.Tensor, shapes: Shapes | None, world: int) -> Payload:
        acc = self._with_memory(key, flat)
        counts = self._counts(shapes, acc.numel())
        compressed, scales = sign_compress(acc, counts, self.scale)
        bits = pack_signs(acc)
        # A non-finite acc makes its run's scale non-finite: every rank's result shows it.
        self._stage("memory", key, acc.sub_(compressed), scaled=True)
        return Payload((bits, scales), "all_gather", context=counts)

    def decompress(self, payload: Payload, received: Sequence[torch.Tensor], out: torch.Tensor, world: int) -> None:
        bits, scales = received
        counts = payload.context
        numel = out.numel()
        signs = unpack_signs(bits.view(world, -1), numel, torch.float32)  # world x numel
        per_element = torch.repeat_interleave(scales.view(world, -1), torch.tensor(counts, device=out.device), dim=1)
        out.copy_((signs * per_element).mean(0))

    def wire_bytes(self, shapes: Shapes, world: int, element_size: int = 4) -> int:
        numel = total_numel(shapes)
        n_scales = len(self._counts(shapes, numel))
        return ring_all_gather((numel + 7) // 8, 1, world) + ring_all_gather(n_scales, 4, world)


def sign_compress(acc: torch.Tensor, counts: list[int], scale: str = "l1") -> tuple[torch.Tensor, torch.Tensor]:
    """(scale_j x sign(acc_j) for every run j, the fp32 scales): the scaled sign of EF-signSGD (scale "l1": mean
    |acc_j|) or of DeepSpeed's 1-bit Adam ("rms": ||acc_j||_2 / sqrt(numel_j))."""
    sizes = torch.tensor(counts, device=acc.device)
    segment = torch.repeat_interleave(torch.arange(len(counts), device=acc.device), sizes)
    total = torch.zeros(len(counts), dtype=torch.float32, device=acc.device)
    if scale == "rms":
        total.index_add_(0, segment, acc.float().square())
        scales = (total / sizes.clamp(min=1)).sqrt()
    else:
        total.index_add_(0, segment, acc.abs().float())
        scales = total / sizes.clamp(min=1)
    signs = torch.where(acc >= 0, 1.0, -1.0).to(acc.dtype)
    return signs * scales[segment].to(acc.dtype), scales
