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
DGC's momentum correction and gradient clipping are the optimizer's business here; warm-up: use a larger ratio.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .base import Compressor, Payload, Shapes, check_ratio, nbytes, ring_all_gather, ring_all_reduce, total_numel

__all__ = ["TopK"]


class TopK(Compressor):
    """Top-k sparsification with error feedback; `ratio` in (0, 1] is the fraction of elements sent per bucket."""

    name = "topk"

    def __init__(self, ratio: float) -> None:
        super().__init__()
        self.ratio = check_ratio("TopK", ratio)

    def config(self) -> dict:
        return {"method": self.name, "ratio": self.ratio}

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

    def compress(self, key: str, flat: torch.Tensor, shapes: Shapes | None, world: int) -> Payload:
        acc = self._with_memory(key, flat)
        numel = acc.numel()
        _, index = acc.abs().topk(self.k(numel), sorted=False)
        values = acc[index]
        acc[index] = 0
        self.memory[key] = acc  # what was not sent
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
