"""The box geometry of the layout contract: flat ranges as boxes, and the views a placement holds, checked against
tensors built by hand (property-based: every shape, split, permutation and flat range that hypothesis draws)."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from shardwise import layout


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.data())
def test_split_flat_range_covers_exactly_the_range_in_order(shape, data):
    n = math.prod(shape)
    lo = data.draw(st.integers(0, n))
    hi = data.draw(st.integers(lo, n))
    full = torch.arange(n).view(shape)
    boxes = layout.split_flat_range(layout.full_box(shape), lo, hi)
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
    got = torch.cat([full[layout.box_slices(b)].reshape(-1) for b in boxes]) if boxes else torch.empty(0)
    assert torch.equal(got, torch.arange(lo, hi))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_held_views_are_exactly_the_held_elements(data):
    """A slice made of k blocks of a 2-D tensor along either dim, optionally stored transposed, of which a flat
    range is held (ZeRO over tensor parallel): every view equals the dense tensor's box, and they cover the range."""
    rows, cols, k = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4)), data.draw(st.integers(1, 3))
    dim = data.draw(st.sampled_from([0, 1]))
    perm = data.draw(st.sampled_from([None, (1, 0)]))
    width = (rows, cols)[dim]
    shape = [rows, cols]
    shape[dim] = width * k * 2  # k blocks, each split in 2 ranks; this rank holds the second half of each
    dense = torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
    boxes = []
    for b in range(k):
        box = [(0, rows), (0, cols)]
        box[dim] = (2 * b * width + width, width)
        boxes.append(tuple(box))
    local = torch.cat([dense[layout.box_slices(b)] for b in boxes], dim=dim)
    stored = local if perm is None else local.permute(perm).contiguous()
    lo = data.draw(st.integers(0, stored.numel()))
    hi = data.draw(st.integers(lo, stored.numel()))
    param = nn.Parameter(stored.reshape(-1)[lo:hi].clone())
    pl = layout.Placement(("w",), tuple(shape), param, boxes=tuple(boxes), concat_dim=dim, stored_perm=perm,
                          flat=(lo, hi))
    views = layout.held_views(pl, param.detach())
    assert sum(v.numel() for _, v in views) == hi - lo
    for box, view in views:
        assert torch.equal(view, dense[layout.box_slices(box)])
    for box, view in views:  # the views write through to the parameter
        view.fill_(-1)
    assert bool((param == -1).all())
