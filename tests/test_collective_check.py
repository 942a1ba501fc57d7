"""Mismatched collectives raise on gloo instead of pairing silently (issue 29, comm/collective_check.py): a rank
evaluating a ZeRO-3 model alone, or all-reducing another size, gets a CommError naming every rank's call."""

from __future__ import annotations

import pytest
from collective_check_cases import rank0_only_eval, sizes_differ

import shardwise as sw


@pytest.mark.multiprocess
def test_rank0_only_evaluation_of_a_zero3_model_is_named_not_trained_through():
    with pytest.raises(sw.LaunchError) as info:
        sw.launch(rank0_only_eval, 2, backend="gloo", timeout=60)
    text = str(info.value)
    assert "collectives do not match across the group [0, 1]" in text, text
    assert "rank 0 called all_gather(" in text and "rank 1 called " in text, text


# On MPI sizes_differ runs inside tests/test_mpi.py's 2-rank launch (an mpirun costs seconds).
@pytest.mark.multiprocess
def test_all_reduces_of_other_sizes_are_named():
    with pytest.raises(sw.LaunchError) as info:
        sw.launch(sizes_differ, 2, backend="gloo", timeout=60)
    text = str(info.value)
    assert "collectives do not match across the group [0, 1]" in text, text
    assert "rank 0 called all_reduce(op=SUM, numel=4) float32" in text, text
    assert "rank 1 called all_reduce(op=SUM, numel=6) float32" in text, text
