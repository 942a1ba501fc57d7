"""Boxes: the geometry of pieces of a global tensor, which the layout contract (layout.py) and checkpoints speak in.

A *box* is ``((start, size), ...)``, one pair per dim of the global tensor: the N-d block a rank's slice, a
checkpoint piece or a state-dict slice covers. ZeRO and FSDP keep a flat range ``[lo, hi)`` of a row-major
flattening instead; :func:`split_flat_range` turns such a range back into at most ``2 x ndim - 1`` boxes (a partial
first row, whole rows, a partial last row, recursively), which is why every piece is a plain box and any layout
reloads onto any other.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["Box", "full_box", "box_slices", "box_numel", "intersect", "split_flat_range", "inverse_perm"]

Box = tuple[tuple[int, int], ...]


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def box_slices(box: Box, origin: Box | None = None) -> tuple[slice, ...]:
    """Index of `box` in a tensor covering `origin` (the whole global tensor when None)."""
    if origin is None:
        return tuple(slice(s, s + n) for s, n in box)
    return tuple(slice(s - o, s - o + n) for (s, n), (o, _) in zip(box, origin))


def box_numel(box: Box) -> int:
    return math.prod(n for _, n in box)


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes of the same tensor, or None."""
    out = []
    for (sa, na), (sb, nb) in zip(a, b):
        lo, hi = max(sa, sb), min(sa + na, sb + nb)
        if hi <= lo:
            return None
        out.append((lo, hi - lo))
    return tuple(out)


def split_flat_range(box: Box, lo: int, hi: int) -> list[Box]:
    """The elements [lo, hi) of `box`'s row-major flattening as boxes, in flat order (at most 2 x ndim - 1)."""
    if hi <= lo:
        return []
    if not box:
        return [()]  # a scalar: one element
    (start, _), rest = box[0], box[1:]
    inner = box_numel(rest)
    first, last = lo // inner, (hi - 1) // inner
    if first == last:
        return [((start + first, 1), *sub) for sub in split_flat_range(rest, lo - first * inner, hi - first * inner)]
    out: list[Box] = []
    if lo % inner:
        out += [((start + first, 1), *sub) for sub in split_flat_range(rest, lo % inner, inner)]
        first += 1
    whole_end = hi // inner
    if whole_end > first:
        out.append(((start + first, whole_end - first), *rest))
    if hi % inner:
        out += [((start + whole_end, 1), *sub) for sub in split_flat_range(rest, 0, hi % inner)]
    return out


def inverse_perm(perm: tuple[int, ...]) -> tuple[int, ...]:
    """The permutation that undoes `perm` (a stored transpose back to the global tensor's dim order)."""
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return tuple(inv)
