"""sw.agree: one decision every rank takes together. Ranks that vote differently get the same answer; "any" and
"all" differ exactly where they should; bad arguments are named; a rank that never votes is a CommError, not a
hang; gloo processes agree too."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import shardwise as sw


def votes_of(pattern):
    """A rank body voting pattern[rank] under both rules; returns (any, all) as this rank saw them."""
    def body(comm):
        mine = pattern[comm.rank]
        return sw.agree(mine, comm, how="any"), sw.agree(mine, comm, how="all")

    return body


@pytest.mark.parametrize("pattern", [(False, False, False, False), (True, False, False, False),
                                     (False, False, False, True), (True, True, False, True), (True,) * 4])
def test_ranks_that_disagree_get_the_same_answer(pattern):
    results = sw.launch(votes_of(pattern), len(pattern))
    assert results == [(any(pattern), all(pattern))] * len(pattern)


def test_default_is_any_and_flags_may_be_tensors_ints_and_numpy_bools():
    kinds = [torch.tensor(True), 0, np.bool_(False), torch.tensor([0], dtype=torch.int64)]

    def body(comm):
        return sw.agree(kinds[comm.rank], comm), sw.agree(kinds[comm.rank], comm, how="all")

    assert sw.launch(body, 4) == [(True, False)] * 4


def test_a_world_of_one_answers_its_own_vote_without_communicating():
    def body(comm):
        with comm.stats.measure() as counted:
            answer = (sw.agree(True, comm, "all"), sw.agree(False, comm, "any"))
        return answer, counted.calls()

    assert sw.launch(body, 1) == [((True, False), 0)]


def test_one_four_byte_all_reduce_per_decision():
    def body(comm):
        with comm.stats.measure() as counted:
            sw.agree(comm.rank == 0, comm)
        return counted.calls(), counted.bytes()

    assert sw.launch(body, 2) == [(1, 4)] * 2


@pytest.mark.parametrize("how", ["majority", "ANY", None])
def test_an_unknown_rule_is_named_with_what_is_allowed(how):
    def body(comm):
        with pytest.raises(ValueError, match=r"agree: how=.* is not supported; allowed: \['all', 'any'\]"):
            sw.agree(True, comm, how=how)

    sw.launch(body, 2)


@pytest.mark.parametrize("flag", [2, 0.5, "yes", None, torch.tensor([1, 0]), torch.tensor(1.0)])
def test_a_flag_that_is_not_a_bool_is_refused(flag):
    def body(comm):
        with pytest.raises(ValueError, match=r"agree: flag"):
            sw.agree(flag, comm)

    sw.launch(body, 2)


def test_a_comm_that_is_not_a_communicator_is_refused():
    with pytest.raises(ValueError, match=r"agree: comm must be a shardwise Communicator.*got int"):
        sw.agree(True, 4)


def test_a_rank_that_never_votes_is_a_comm_error_within_the_timeout():
    def body(comm):
        if comm.rank == 0:
            sw.agree(True, comm)

    with pytest.raises(sw.LaunchError, match="CommError"):
        sw.launch(body, 2, timeout=1.0)


def gloo_body(comm):
    return sw.agree(comm.rank == 1, comm, "any"), sw.agree(comm.rank == 1, comm, "all")


@pytest.mark.multiprocess
def test_gloo_processes_agree():
    assert sw.launch(gloo_body, 2, backend="gloo", timeout=60.0) == [(True, False)] * 2
