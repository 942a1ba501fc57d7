"""RandomK(ratio): send k = ceil(ratio x numel) elements of each bucket chosen at random, keep the rest as error
feedback (Stich et al., "Sparsified SGD with Memory", NeurIPS 2018, rand-k with memory).

Mechanism, per bucket and step on each rank:
1. acc = gradient + memory;
2. the k indices are drawn from a generator seeded identically on every rank by (seed, bucket, step): all ranks
   pick the *same* indices, so the indices never travel and the k values are summed by one **all-reduce of k
   elements** (a sparse all-reduce: the cheapest exchange of any sparsifier, k x 4 bytes, against TopK's
   all-gather of N x k values and indices);
3. memory = acc with those entries zeroed; the bucket becomes zeros except the averaged k values.
A fresh draw every step means every element is sent about once per 1/ratio steps, so the memory stays bounded.
The draw costs a `randperm` of the bucket on the host (O(numel)), comparable to TopK's selection.

Stated error: exactly the average of the k selected entries (up to summation order); the rest is in the memory.
Bytes on the wire per bucket: one all-reduce of k x 4 bytes: 2(N-1)/N x 4k per rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .base import (Compressor, Payload, Shapes, check_ratio, check_start_iter, ring_all_reduce, shared_generator,
                   total_numel, with_start_iter)

__all__ = ["RandomK"]


class RandomK(Compressor):
    """Random-k sparsification with shared indices and error feedback (see the module docstring)."""

    name = "randomk"

    def __init__(self, ratio: float, seed: int = 0, start_iter: int = 0) -> None:
        super().__init__()
        self.ratio = check_ratio("RandomK", ratio)
        self.start_iter = check_start_iter("RandomK", start_iter)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"RandomK: seed={seed!r} must be an int (the same on every rank)")
        self.seed = seed

    def config(self) -> dict:
        return with_start_iter({"method": self.name, "ratio": self.ratio, "seed": self.seed}, self.start_iter)

    def k(self, numel: int) -> int:
        return min(numel, max(1, math.ceil(self.ratio * numel))) if numel else 0

    def compress(self, key: str, flat: torch.Tensor, shapes: Shapes | None, world: int) -> Payload:
        acc = self._with_memory(key, flat)
        numel = acc.numel()
        generator = shared_generator(self.seed, key, self.iterations[key])
        index = torch.randperm(numel, generator=generator)[: self.k(numel)].to(acc.device)
        values = acc[index]
        acc[index] = 0
        # An unsent NaN would stay in this rank's memory with a finite result everywhere: the memory's sum times 0
        # (NaN exactly when the memory is not finite) rides in the values, so every rank's result shows it.
        values.add_(self._stage("memory", key, acc, scaled=True).mul(0))
        return Payload((values,), "all_reduce", context=index)

    def decompress(self, payload: Payload, received: Sequence[torch.Tensor], out: torch.Tensor, world: int) -> None:
        out.zero_()
        out[payload.context] = received[0].to(out.dtype) / world

    def wire_bytes(self, shapes: Shapes, world: int, element_size: int = 4) -> int:
        return ring_all_reduce(self.k(total_numel(shapes)), element_size, world)
