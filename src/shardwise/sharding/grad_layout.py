"""Where a unit's gradients and "used" flags sit in its flat gradient buffer.

Why flags. A parameter that no rank used in a step must keep `.grad = None`, as in one process, so that every
torch optimizer skips it (AdamW would otherwise apply weight decay and old momentum to it: the mixture-of-experts
expert that got no token, the branch taken only sometimes). A rank only knows what *it* used; the reduce-scatter
leaves it a shard of the *average*, in which a zero gradient and no gradient look alike. So each rank adds one
flag per trainable parameter of the unit (1 = this rank wrote a gradient for it this cycle, 0 = not) to the
buffer it reduces: after the average, a flag is positive exactly when some rank used the parameter. The flags ride
in the reduction that moves the gradients anyway: no extra collective, k elements per rank per unit.

Layout. A reduce-scatter hands rank r the r-th of N equal consecutive chunks, and every rank must learn every
flag, so each chunk carries a copy of all k flags after its `shard` data elements::

    [ data 0 .. s-1 | flags 0..k-1 ][ data s .. 2s-1 | flags 0..k-1 ] ... N chunks of `segment = s + k`

A parameter's gradient (a run of the unit's flat data space) is therefore written in at most one piece per chunk
it crosses. With gradient compression the flags travel in a small all-reduce of their own instead (`band = 0`):
a lossy method would not keep them exact, and whole-matrix methods (PowerSGD) need the data contiguous.
"""

from __future__ import annotations

import torch

__all__ = ["GradLayout"]


class GradLayout:
    """N chunks of `shard` data elements, each followed by `band` flag elements (see the module docstring)."""

    def __init__(self, ranks: int, shard: int, band: int) -> None:
        self.ranks = ranks
        self.shard = shard
        self.band = band
        self.segment = shard + band
        self.numel = ranks * self.segment

    def runs(self, start: int, numel: int) -> list[tuple[int, int, int]]:
        """The data elements [start, start + numel) of the unit's flat (unpadded) layout as
        (buffer offset, offset within the run's source, length) pieces, one per chunk crossed."""
        if self.band == 0:
            return [(start, 0, numel)] if numel else []
        out, pos, end = [], start, start + numel
        while pos < end:
            chunk = pos // self.shard
            stop = min(end, (chunk + 1) * self.shard)
            out.append((chunk * self.segment + pos - chunk * self.shard, pos - start, stop - pos))
            pos = stop
        return out

    def own(self, buffer: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s data chunk of the buffer (a view)."""
        begin = rank * self.segment
        return buffer[begin : begin + self.shard]

    def write_flags(self, buffer: torch.Tensor, used: list[bool]) -> None:
        """Put this rank's flags into every chunk's band (only when the flags travel in band). Filled in runs of
        equal flags on the device (one fill when all were used): a host list copied to a GPU would block the host
        until the GPU caught up, once per unit in the middle of backward."""
        if not self.band:
            return
        band = buffer.view(self.ranks, self.segment)[:, self.shard :]
        start = 0
        for i in range(1, len(used) + 1):
            if i == len(used) or used[i] != used[start]:
                band[:, start:i].fill_(1.0 if used[start] else 0.0)
                start = i

    def read_flags(self, reduced: torch.Tensor, used_here: list[bool]) -> list[bool]:
        """Which parameters some rank used, from a reduced chunk (`segment` elements: data, then the band). When this
        rank used them all, so did "some rank": no read (reading a GPU tensor on the host waits for the GPU)."""
        if all(used_here):
            return list(used_here)
        return (reduced[self.shard : self.segment] > 0).tolist()
