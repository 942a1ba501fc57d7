"""TopK(ratio): send only the k = ceil(ratio x numel) largest-magnitude elements of each bucket, keep the rest as
error feedback (Lin et al., "Deep Gradient Compression", arXiv 1712.01887; Stich et al., "Sparsified SGD with
Memory", 2018).

Mechanism, per bucket and step on each rank:
1. acc = gradient + memory (what earlier steps did not send);
2. the k entries of largest |acc| are selected (`torch.topk`); memory = acc with those k entries zeroed;
3. ranks choose different indices, so the sparse contributions are exchanged by an **all-gather of the values and
   the indices** (int32 while the bucket has < 2^31 elements): N x k of each arrive on every rank, which scatters
   them (`index_add_`, so repeated indices add up) and divides by N. When that would cost more than a dense
   all-reduce of the sparsified bucket (large ratio or many ranks), the dense all-reduce is used instead: the
   same result, fewer bytes. The choice depends only on (numel, ratio, N), so every rank makes the same one.

Stated error: the result is exactly the average of the ranks' top-k parts (up to float summation order); each
rank's unsent part stays in its memory, so sum over steps of what it sent = sum of its gradients - memory. Top-k
keeps ||x - topk(x)||^2 <= (1 - ratio) ||x||^2, so for gradients bounded by G the memory stays bounded (about
2 sqrt(1 - ratio) / ratio x G; Stich et al. 2018, Lemma 3.2) and the gap between the sums does not grow.
Bytes on the wire per bucket: min(all-gather (N-1) x k x (4 + 4), all-reduce 2(N-1)/N x numel x 4) per rank.

DGC's momentum correction (`momentum_correction=m`, Lin et al. section 3.1). Top-k of plain gradients under a
momentum optimizer loses momentum on the coordinates that wait in memory: their delayed update is a sum of
gradients, not of velocities. DGC moves the momentum into the compressor: each rank keeps a velocity
u = m u + g and accumulates v = v + u (v is the memory), sends the top-k of v, and then zeroes *both* u and v at the
sent coordinates (momentum factor masking: a sent coordinate's old velocity would otherwise push it again, stale).
The optimizer must then be momentum-free (`torch.optim.SGD(params, lr, momentum=0)`): what arrives is already the
averaged, momentum-corrected update. At ratio 1 every coordinate is masked every step, so no momentum survives:
use it with sparse ratios, as the paper does.
Local gradient clipping (`clip_norm=C`, section 3.2): before it is accumulated, each rank's gradient is rescaled so
that its L2 norm is at most C N^(-1/2) (N ranks: the sum of N independent gradients has about sqrt(N) times the
norm of one). The compressor sees one bucket at a time, so the norm is the bucket's (DGC clips the whole local
gradient); with one bucket (`bucket_mb` above the model's size) the two agree.
Warm-up (DGC's exponentially growing sparsity): use a larger ratio for the first epochs.

Under Adam: what waits in memory arrives late and summed, and the sum over the steps a coordinate waited is already
a momentum (staleness acts as momentum: Mitliagkas et al. 2016), which Adam's default beta1 0.9 compounds. Measured
on the demo GPT (docs/compression.md, "Delay"): with `AdamW(betas=(0.3, 0.999))` and `TopK(0.01, start_iter=20)`
(a tenth of the 200 steps exact) the final loss came within 3% of uncompressed AdamW on five seeds of five (worst
+1.7%), where TopK(0.01) with beta1 0.9 and no warm-up missed by 13-18%.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .base import (Compressor, Payload, Shapes, check_ratio, check_start_iter, nbytes, ring_all_gather, ring_all_reduce,
                   total_numel, with_start_iter)

__all__ = ["TopK"]


class TopK(Compressor):
    """Top-k sparsification with error feedback (see the module docstring).

    ratio: the fraction of elements sent per bucket, in (0, 1].
    momentum_correction: DGC's momentum m in [0, 1), kept per rank in the compressor (the optimizer must then have
        no momentum), or None (plain error feedback of gradients; the optimizer keeps its momentum).
    clip_norm: DGC's local gradient clipping threshold C > 0 (each rank's bucket gradient clipped to norm
        C / sqrt(N) before accumulation), or None.
    start_iter: the first reductions of each bucket done exactly (fp32 all-reduce), as DGC's warm-up.
    """

    name = "topk"

    def __init__(self, ratio: float, momentum_correction: float | None = None,
                 clip_norm: float | None = None, start_iter: int = 0) -> None:
        super().__init__()
        self.ratio = check_ratio("TopK", ratio)
        self.start_iter = check_start_iter("TopK", start_iter)
        if momentum_correction is not None and (isinstance(momentum_correction, bool) or not isinstance(
                momentum_correction, (int, float)) or not 0 <= momentum_correction < 1):
            raise ValueError(f"TopK: momentum_correction={momentum_correction!r} must be None or a momentum in "
                             f"[0, 1) (DGC's 0.9), with a momentum-free optimizer")
        if clip_norm is not None and (isinstance(clip_norm, bool) or not isinstance(clip_norm, (int, float))
                                      or not clip_norm > 0 or math.isinf(clip_norm)):
            raise ValueError(f"TopK: clip_norm={clip_norm!r} must be None or a finite number > 0 (the global "
                             f"gradient-norm threshold; each rank clips its bucket to clip_norm / sqrt(ranks))")
        self.momentum_correction = None if momentum_correction is None else float(momentum_correction)
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        self._reset_extra_state()

    def _reset_extra_state(self) -> None:
        self.velocity: dict[str, torch.Tensor] = {}  # DGC's u per bucket (momentum_correction only)

    def config(self) -> dict:
        config = {"method": self.name, "ratio": self.ratio}
        if self.momentum_correction is not None:
            config["momentum_correction"] = self.momentum_correction
        if self.clip_norm is not None:
            config["clip_norm"] = self.clip_norm
        return with_start_iter(config, self.start_iter)

    def k(self, numel: int) -> int:
        return min(numel, max(1, math.ceil(self.ratio * numel))) if numel else 0

    @staticmethod
    def index_dtype(numel: int) -> torch.dtype:
        return torch.int32 if numel < 2**31 else torch.int64

    def _dense_is_cheaper(self, numel: int, element_size: int, world: int) -> bool:
        k = self.k(numel)
        sparse = (ring_all_gather(k, element_size, world)
                  + ring_all_gather(k, nbytes(1, self.index_dtype(numel)), world))
        return ring_all_reduce(numel, element_size, world) < sparse

    def _corrected(self, key: str, flat: torch.Tensor, world: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(what enters the accumulation, the velocity or None): the bucket after DGC's local clipping and, with
        momentum correction, the updated velocity u = m u + g: a new tensor in the bucket's (loss-scaled) units,
        which the caller stages once it is final."""
        grad = flat.detach()
        if self.clip_norm is not None:
            # DGC's local clipping: the threshold scaled by N^-1/2 (the ranks' gradients add up like random walks),
            # in the bucket's units (times the loss scale).
            # A tensor factor min(limit / norm, 1): the host never reads the norm (on a GPU that would stall the
            # queue once per bucket per step), and a bucket under the threshold is multiplied by exactly 1.
            limit = self.clip_norm * self.loss_scale / math.sqrt(world)
            grad = grad * torch.clamp(limit / torch.linalg.vector_norm(grad), max=1.0)
        velocity = None
        if self.momentum_correction is not None:
            velocity = self.velocity.get(key)
            if velocity is None:
                velocity = grad.clone()
            elif velocity.shape != grad.shape:
                raise ValueError(f"TopK: bucket {key!r} has {grad.numel()} elements but its velocity "
                                 f"{velocity.numel()}: the model's buckets changed after a resume")
            else:  # a new tensor: the velocity before the step stays untouched until the step is settled
                velocity = torch.add(grad, velocity, alpha=self.momentum_correction * self.loss_scale)
            grad = velocity  # v accumulates velocities, not gradients
        return grad, velocity

    def _exact(self, key: str, flat: torch.Tensor, world: int) -> torch.Tensor:
        # During a warm-up the velocity keeps running (nothing is masked: everything is sent), so with a
        # momentum-free optimizer the warm-up is exactly momentum SGD on the averaged (clipped) gradient.
        if self.momentum_correction is None and self.clip_norm is None:
            return flat
        grad, velocity = self._corrected(key, flat, world)
        flat.copy_(grad)
        if velocity is not None:
            self._stage("velocity", key, velocity, scaled=True)
        return flat

    def compress(self, key: str, flat: torch.Tensor, shapes: Shapes | None, world: int) -> Payload:
        grad, velocity = self._corrected(key, flat, world)
        acc = self._with_memory(key, grad)
        numel = acc.numel()
        _, index = acc.abs().topk(self.k(numel), sorted=False)
        values = acc[index]
        acc[index] = 0
        # What was not sent; a NaN left in it would not show in the result, so the new state's sum times 0 (NaN
        # exactly when the state is not finite) rides in the values and every rank's result shows it.
        poison = self._stage("memory", key, acc, scaled=True).mul(0)
        if velocity is not None:
            velocity[index] = 0  # momentum factor masking: a sent coordinate starts its velocity afresh
            poison = poison + self._stage("velocity", key, velocity, scaled=True).mul(0)
        values.add_(poison)
        if self._dense_is_cheaper(numel, acc.element_size(), world):
            dense = torch.zeros_like(acc)
            dense[index] = values
            return Payload((dense,), "all_reduce", context="dense")
        return Payload((values, index.to(self.index_dtype(numel))), "all_gather", context="sparse")

    def decompress(self, payload: Payload, received: Sequence[torch.Tensor], out: torch.Tensor, world: int) -> None:
        if payload.context == "dense":
            torch.div(received[0], world, out=out)
            return
        values, index = received
        out.zero_()
        out.index_add_(0, index.long(), values.to(out.dtype))
        out.div_(world)

    def wire_bytes(self, shapes: Shapes, world: int, element_size: int = 4) -> int:
        numel = total_numel(shapes)
        if self._dense_is_cheaper(numel, element_size, world):
            return ring_all_reduce(numel, element_size, world)
        k = self.k(numel)
        return ring_all_gather(k, element_size, world) + ring_all_gather(k, nbytes(1, self.index_dtype(numel)), world)

    # ---- checkpoints: DGC's velocity is state too ---------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        state = super().state_dict()
        state.update({f"velocity/{k}": v.detach().clone() for k, v in self.velocity.items()})
        return state

    def _load_extra(self, kind: str, key: str, value: torch.Tensor) -> bool:
        if kind == "velocity":
            self.velocity[key] = value.detach().clone()
            return True
        return False

    def _extra_kind_names(self) -> tuple[str, ...]:
        return ("velocity",)
