"""sw.elastic.Sampler: one global order, exact sample accounting across world resizes, bad G / W refused."""

from __future__ import annotations

import collections

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardwise as sw

Sampler = sw.elastic.Sampler


def _segment(state: dict, world: int, steps: int, *, n: int, g: int, micro: int | None,
             seed: int) -> list[list[int]]:
    """Run `steps` optimizer steps on a fresh world of `world` samplers restored from `state` (as restarted or
    regrouped ranks would be); return each step's global batch, assembled from what every rank read through its
    iterator. `state` is updated to the committed position at the end."""
    ranks = []
    for r in range(world):
        s = Sampler(n, global_batch=g, micro_batch=micro, seed=seed)
        s.load_state_dict(state)
        s.set_world(r, world)
        ranks.append(s)
    streams = [s.micro_batches() for s in ranks]
    trained = []
    for _ in range(steps):
        batch: list[int] = []
        for s, stream in zip(ranks, streams):
            for _ in range(s.plan.accumulation):
                micro_batch = next(stream)
                assert len(micro_batch) == s.plan.micro_batch
                batch += micro_batch
        trained.append(batch)
        for s in ranks:
            s.advance()
        if ranks[0].step_in_epoch == 0:  # a new epoch: its order starts afresh
            streams = [s.micro_batches() for s in ranks]
    state.clear()
    state.update(ranks[0].state_dict())
    return trained


@settings(max_examples=60, deadline=None)
@given(
    g_units=st.integers(1, 3),
    n_extra=st.integers(0, 40),
    segments=st.lists(st.tuples(st.sampled_from([1, 2, 3, 4, 6, 12]), st.integers(0, 7)), min_size=1, max_size=6),
    micro=st.sampled_from([None, 1]),
    seed=st.integers(0, 2**16),
)
def test_exact_accounting_across_resizes(g_units, n_extra, segments, micro, seed):
    g = 12 * g_units  # divisible by every world size drawn
    n = g + n_extra
    reference = Sampler(n, global_batch=g, seed=seed)
    state = reference.state_dict()
    trained: list[list[int]] = []
    for world, steps in segments:
        trained += _segment(state, world, steps, n=n, g=g, micro=micro, seed=seed)
    # the same global batches, in the same order, as one process reading the global order
    expected = []
    for _ in trained:
        expected.append(reference.global_batch_indices())
        reference.advance()
    assert [sorted(b) for b in trained] == [sorted(b) for b in expected]
    # no sample seen twice within an epoch, and every step saw exactly G samples
    per_epoch = collections.defaultdict(list)
    for step, batch in enumerate(trained):
        assert len(batch) == g
        per_epoch[step // (n // g)] += batch
    for epoch, seen in per_epoch.items():
        assert len(seen) == len(set(seen)), f"epoch {epoch}: a sample was read twice"
    complete = [e for e in per_epoch if len(per_epoch[e]) == (n // g) * g]
    for e in complete:  # a finished epoch read all but the n mod G dropped samples
        assert len(set(per_epoch[e])) == n - n % g
    assert state["epoch"] * (n // g) + state["step_in_epoch"] == len(trained)


def test_rank_shares_partition_the_global_batch_and_accumulation_keeps_g():
    for world in (1, 2, 3, 4, 6):
        s = Sampler(96, global_batch=24, micro_batch=2, seed=3)
        plans = [s.set_world(r, world) for r in range(world)]
        assert plans[0].per_rank * world == 24 and plans[0].accumulation * plans[0].micro_batch == plans[0].per_rank
        shares = []
        for r in range(world):
            s.set_world(r, world)
            shares += s.rank_indices()
        assert shares == s.global_batch_indices()


def test_order_is_seeded_per_epoch_and_differs_between_epochs():
    a, b = Sampler(30, global_batch=10, seed=7), Sampler(30, global_batch=10, seed=7)
    assert list(a) == list(b)
    first = a.global_batch_indices()
    a.advance(3)
    assert a.epoch == 1 and a.global_batch_indices() != first
    assert Sampler(30, global_batch=10, seed=8).global_batch_indices() != first
    assert Sampler(30, global_batch=10, shuffle=False).global_batch_indices() == list(range(10))


def test_prefetching_does_not_move_the_position():
    s = Sampler(48, global_batch=12, seed=0)
    s.set_world(0, 3)
    loader = torch.utils.data.DataLoader(list(range(48)), sampler=s, batch_size=s.plan.micro_batch)
    first = next(iter(loader)).tolist()
    assert first == s.rank_indices() and s.position == 0 and len(s) == 4 * 4
    s.advance()
    assert next(iter(loader)).tolist() == s.rank_indices(step=1)


def test_state_dict_round_trip_and_mismatch_named():
    s = Sampler(100, global_batch=12, seed=1)
    s.advance(10)
    t = Sampler(100, global_batch=12, seed=1)
    t.load_state_dict(s.state_dict())
    assert (t.epoch, t.step_in_epoch, t.samples_seen) == (1, 2, 120)
    with pytest.raises(ValueError, match=r"seed: saved 1, here 2"):
        Sampler(100, global_batch=12, seed=2).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match=r"global_batch: saved 12, here 24"):
        Sampler(100, global_batch=24, seed=1).load_state_dict(s.state_dict())


def test_bad_global_batch_and_world_sizes_are_named():
    with pytest.raises(ValueError, match=r"global_batch=16 is not divisible by world_size=3.*allowed: \[1, 2, 4, 8, 16\]"):
        Sampler(64, global_batch=16, world_sizes=range(2, 5))
    s = Sampler(64, global_batch=24, micro_batch=4)
    with pytest.raises(ValueError, match=r"world_size x micro_batch = 4 x 4.*allowed: \[1, 2, 3, 6\]"):
        s.set_world(0, 4)
    with pytest.raises(ValueError, match=r"rank=3 must be an int in \[0, 3\)"):
        s.set_world(3, 3)
    with pytest.raises(ValueError, match=r"global_batch=65 is more than the 64 samples"):
        Sampler(64, global_batch=65)
    with pytest.raises(ValueError, match=r"global_batch=0 must be a positive int"):
        Sampler(64, global_batch=0)
