"""Mesh layout (tp fastest, then cp, then dp, then pp; ep borrowed from dp x cp), its sub-communicators, and its
validation errors."""

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
    assert sizes == {"dp": 2, "cp": 1, "ep": 1, "edp": 2, "tp": 2, "pp": 1}
    assert "dp 1: [2 3]" in text and "dp=2 x tp=2 x pp=1" in text


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"dp": 2, "tp": 2, "pp": 2}, r"dp x cp x tp x pp = 2 x 1 x 2 x 2 = 8, but the world has 4 ranks"),
        ({"dp": 3}, r"= 3, but the world has 4 ranks"),
        ({"tp": 3}, r"cp x tp x pp = 1 x 3 x 1 = 3 does not divide the world size 4"),
        ({"cp": 3}, r"cp x tp x pp = 3 x 1 x 1 = 3 does not divide the world size 4"),
        ({"dp": 2, "tp": 2, "ep": 4}, r"ep=4 must divide dp x cp = 2 x 1 = 2"),
        ({"ep": 3}, r"ep=3 must divide dp x cp = 4 x 1 = 4"),
        ({"cp": 0}, r"cp=0 must be a positive int"),
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


@pytest.mark.parametrize("dp, cp, ep, tp, pp", [(2, 2, 2, 2, 1), (2, 2, 4, 1, 2), (4, 2, 2, 1, 1), (1, 4, 2, 2, 1)])
def test_five_axes_layout_and_groups(dp, cp, ep, tp, pp):
    def body(comm):
        mesh = sw.Mesh(comm, dp=dp, cp=cp, ep=ep, tp=tp, pp=pp)
        groups = {}
        for axis in ("dp", "cp", "tp", "pp", "dp_cp", "ep", "edp"):
            sub = getattr(mesh, axis)
            t = torch.tensor([float(comm.rank)])
            sub.all_reduce(t)  # the sum of the group's world ranks proves who is in it
            groups[axis] = (list(sub.global_ranks), sub.rank, t.item())
        return mesh.coords, groups

    for rank, (c, groups) in enumerate(sw.launch(body, dp * cp * tp * pp)):
        assert rank == sw.Mesh.rank_of(c.dp, c.tp, c.pp, dp=dp, tp=tp, cp=cp, cp_index=c.cp)

        def at(d=c.dp, k=c.cp, t=c.tp, p=c.pp):
            return ((p * dp + d) * cp + k) * tp + t

        flat = [at(d=f // cp, k=f % cp) for f in range(dp * cp)]  # the dp x cp ranks of this (tp, pp), by index f
        mine = c.dp * cp + c.cp
        expect = {
            "tp": [at(t=t) for t in range(tp)],
            "cp": [at(k=k) for k in range(cp)],
            "dp": [at(d=d) for d in range(dp)],
            "pp": [at(p=p) for p in range(pp)],
            "dp_cp": flat,
            "ep": flat[mine // ep * ep: mine // ep * ep + ep],
            "edp": flat[mine % ep::ep],
        }
        for axis, members in expect.items():
            got_members, got_rank, total = groups[axis]
            assert got_members == members, (axis, rank)
            assert members[got_rank] == rank
            assert total == sum(members)
        assert c.ep == mine % ep


def test_axes_after_dp_are_keyword_only():
    comm = ThreadWorld(4).communicators()[0]
    with pytest.raises(TypeError):
        sw.Mesh(comm, 2, 2)  # which axis would the second 2 be?


def test_dry_run_describes_five_axes():
    mesh = sw.Mesh.dry_run(16, dp=None, cp=2, ep=4, tp=2, pp=1)
    assert mesh.sizes == {"dp": 4, "cp": 2, "ep": 4, "edp": 2, "tp": 2, "pp": 1}
    text = mesh.describe()
    assert "dp=4 x cp=2 x tp=2 x pp=1, ep=4 (borrowed from dp x cp; edp=2) over 16 ranks" in text
    assert "dp 1 cp 1: [ 6  7]" in text
    assert mesh.cp is None and mesh.ep is None

