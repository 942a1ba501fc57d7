"""Every sharding configuration on 2 gloo processes equals one process (one launch runs them all, to stay quick)."""

from __future__ import annotations

import pytest
from parity import assert_state_close
from sharding_cases import reference, train_sharded

import shardwise as sw

# hybrid_shard1: shard groups of one rank replicated across both (the replicate all-reduce path on gloo);
# hybrid_shard with groups of 4 ranks is covered on threads.
GLOO_CONFIGS = ("zero1", "zero2", "zero3", "shard_grad_op", "no_shard", "hybrid_shard1")


def _all_configs(comm):
    results = {name: train_sharded(comm, name)[0] for name in GLOO_CONFIGS}
    results["zero3+accumulate"] = train_sharded(comm, "zero3", 5, 2)[0]
    return results


@pytest.mark.multiprocess
def test_gloo_parity_for_every_configuration():
    want = reference()[0]
    for per_rank in sw.launch(_all_configs, 2, backend="gloo", timeout=60):
        for name, state in per_rank.items():
            try:
                assert_state_close(state, want)
            except AssertionError as exc:
                raise AssertionError(f"{name}: {exc}") from None
