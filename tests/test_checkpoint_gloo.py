"""Resume determinism on gloo processes: 2K steps straight == K steps, save, fresh processes load, K more; bitwise."""

from __future__ import annotations

import pytest
from checkpoint_cases import state_equal, train

import shardwise as sw


def _straight_and_first_half(comm, root):
    results = {}
    for name in ("ddp", "zero3"):
        results[name] = train(comm, name, 4)
        train(comm, name, 2, None, root / name)
    return results


def _second_half(comm, root):
    return {name: train(comm, name, 2, root / name) for name in ("ddp", "zero3")}


@pytest.mark.multiprocess
def test_resume_in_fresh_processes_is_bitwise_identical(tmp_path):
    straight = sw.launch(_straight_and_first_half, 2, tmp_path, backend="gloo", timeout=60)
    resumed = sw.launch(_second_half, 2, tmp_path, backend="gloo", timeout=60)
    for rank in range(2):
        for name in ("ddp", "zero3"):
            assert state_equal(resumed[rank][name], straight[rank][name]) == [], name
