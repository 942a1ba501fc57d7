"""Mesh layout (tp fastest, then dp, then pp), its sub-communicators, and its validation errors."""

from __future__ import annotations

import itertools

import pytest
import torch

import shardwise as sw
from shardwise.comm import ThreadWorld


@pytest.mark.parametrize("dp, tp, pp", [(2, 2, 2), (8, 1, 1), (1, 8, 1), (1, 1, 8), (2, 4, 1), (4, 1, 2)])
def test_layout_and_sub_communicators(dp, tp, pp):
    def body(comm):
        mesh = sw.Mesh(comm, dp=dp, tp=tp, pp=pp)
        groups = {}
        for axis in ("dp", "tp", "pp"):
            sub = getattr(mesh, axis)
            t = torch.tensor([float(comm.rank)])
            sub.all_reduce(t)  # the sum of the group's world ranks proves who is in it
            groups[axis] = (list(sub.global_ranks), sub.rank, t.item())
        return mesh.coords, groups

    for rank, (coords, groups) in enumerate(sw.launch(body, 8)):
        # tp varies fastest: rank = (pp_index * dp + dp_index) * tp + tp_index
        assert rank == (coords.pp * dp + coords.dp) * tp + coords.tp
        expect = {
            "tp": [(coords.pp * dp + coords.dp) * tp + t for t in range(tp)],
            "dp": [(coords.pp * dp + d) * tp + coords.tp for d in range(dp)],
            "pp": [(p * dp + coords.dp) * tp + coords.tp for p in range(pp)],
        }
        for axis, members in expect.items():
            got_members, got_rank, total = groups[axis]
            assert got_members == members, (axis, rank)
            assert got_rank == getattr(coords, axis)
            assert total == sum(members)


def test_dp_is_inferred_from_the_world():
    def body(comm):
        mesh = sw.Mesh(comm, tp=2)
        return mesh.sizes, mesh.describe()

    sizes, text = sw.launch(body, 4)[0]
    assert sizes == {"dp": 2, "tp": 2, "pp": 1}
    assert "dp 1: [2 3]" in text and "dp=2 x tp=2 x pp=1" in text


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"dp": 2, "tp": 2, "pp": 2}, r"dp x tp x pp = 2 x 2 x 2 = 8, but the world has 4 ranks"),
        ({"dp": 3}, r"= 3, but the world has 4 ranks"),
        ({"tp": 3}, r"tp x pp = 3 x 1 = 3 does not divide the world size 4"),
        ({"tp": 0}, r"tp=0 must be a positive int"),
        ({"pp": -1}, r"pp=-1 must be a positive int"),
        ({"dp": 2.0}, r"dp=2.0 must be a positive int"),
        ({"tp": True}, r"tp=True must be a positive int"),
    ],
)
def test_wrong_shapes_are_value_errors_showing_the_numbers(kwargs, match):
    comm = ThreadWorld(4).communicators()[0]  # validation fails before any collective runs
    with pytest.raises(ValueError, match=match):
        sw.Mesh(comm, **kwargs)


def test_rank_of_inverts_coordinates():
    dp, tp, pp = 3, 2, 2
    ranks = sorted(sw.Mesh.rank_of(d, t, p, dp=dp, tp=tp) for d, t, p in itertools.product(range(dp), range(tp), range(pp)))
    assert ranks == list(range(dp * tp * pp))
