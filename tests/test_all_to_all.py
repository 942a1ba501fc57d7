"""Communicator.all_to_all (comm/all_to_all.py) on thread ranks, gloo processes and MPI: equal and uneven splits,
several dtypes, async, sub-groups, the bytes counted, mismatched calls (CommError naming both), bad arguments.

Every message is computed from (sender, receiver, row) with world ranks, so a tensor delivered to the wrong rank, from
the wrong rank, in the wrong slot or a sub-group that mixed up its members, fails the comparison.
"""

from __future__ import annotations

import time

import pytest
import torch

import shardwise as sw
from shardwise.comm import CommError, Throttled, ThreadWorld, wire_bytes

DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.bool)
COLS = 3


def _rows(src: int, dst: int, split: str) -> int:
    """Rows world rank src sends world rank dst: 2 for equal splits; 0, 1 or 2 for uneven ones."""
    return 2 if split == "equal" else (src + 2 * dst) % 3


def _message(src: int, dst: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """What src sends dst: 4 src + dst + 16 row (exact in bfloat16); for bool, its parity."""
    value = (4 * src + dst + 16 * torch.arange(rows)).unsqueeze(1).expand(rows, COLS)
    return value % 2 == 1 if dtype == torch.bool else value.to(dtype)


def _exchange(comm, split: str, dtype: torch.dtype = torch.float32, async_op: bool = False) -> list[torch.Tensor]:
    """One all_to_all of _message tensors over `comm`; asserts what arrived; returns the inputs."""
    g = comm.global_ranks
    me = g[comm.rank]
    inputs = [_message(me, g[j], _rows(me, g[j], split), dtype) for j in range(comm.size)]
    outputs = [torch.full((_rows(g[i], me, split), COLS), -1).to(dtype) for i in range(comm.size)]
    work = comm.all_to_all(outputs, inputs, async_op=async_op)
    if async_op:
        work.wait()
        assert work.is_completed()
    else:
        assert work is None
    for i, out in enumerate(outputs):
        expected = _message(g[i], me, _rows(g[i], me, split), dtype)
        assert torch.equal(out, expected), f"rank {me} from rank {g[i]} ({split}, {dtype}): {out} != {expected}"
    return inputs


def exercise(comm, splits: tuple[str, ...] = ("equal", "uneven")) -> dict:
    """Every split, dtype and sync/async on the world, a sub-group by parity, and the bytes counted."""
    for split in splits:
        for dtype in DTYPES:
            for async_op in (False, True):
                _exchange(comm, split, dtype, async_op)
    counted = {}
    for split in splits:
        with comm.stats.measure() as step:
            inputs = _exchange(comm, split)
        counted[split] = (step.bytes("all_to_all"), step.wire_bytes("all_to_all"),
                          [t.numel() * t.element_size() for t in inputs])
    sub = comm.split(comm.rank % 2)
    for split in splits:
        _exchange(sub, split, torch.bfloat16, async_op=True)
    return {"counted": counted, "sub": list(sub.global_ranks)}


def _expected_bytes(me: int, size: int, split: str) -> tuple[int, int]:
    """(payload, wire) of one _exchange on a world of `size`, from the split alone: all inputs, those to others."""
    sizes = [_rows(me, j, split) * COLS * 4 for j in range(size)]
    return sum(sizes), sum(sizes) - sizes[me]


def _check_exercise(results: list[dict], size: int) -> None:
    for me, result in enumerate(results):
        for split, (payload, wire, _) in result["counted"].items():
            assert (payload, wire) == _expected_bytes(me, size, split), (me, split)
        assert result["sub"] == [r for r in range(size) if r % 2 == me % 2]
    if size > 1:  # equal splits: the textbook (N-1)/N x the total input
        payload, wire, _ = results[0]["counted"]["equal"]
        assert wire == (size - 1) * payload // size == wire_bytes("all_to_all", payload, size)


def mismatches(comm) -> dict:
    """Rank 0's all_to_all against the others' all_gather; then shapes that do not pair (rank 0 sends rank 1 three
    elements, rank 1 expects two). Both raise CommError on every rank; the group stays usable after them."""
    n, texts = comm.size, {}
    try:
        if comm.rank == 0:
            comm.all_to_all([torch.empty(2) for _ in range(n)], [torch.ones(2) for _ in range(n)])
        else:
            comm.all_gather(torch.empty(2 * n), torch.ones(2))
    except CommError as exc:
        texts["op"] = str(exc)
    try:
        inputs = [torch.ones(3 if comm.rank == 0 and j == 1 else 2) for j in range(n)]
        comm.all_to_all([torch.empty(2) for _ in range(n)], inputs)
    except CommError as exc:
        texts["sizes"] = str(exc)
    _exchange(comm, "uneven")
    return texts


def _check_mismatches(texts: list[dict]) -> None:
    for rank, t in enumerate(texts):
        assert "collectives do not match across the group" in t["op"], t
        assert "rank 0 called all_to_all(send=[2, 2" in t["op"] and "rank 1 called all_gather(numel=2)" in t["op"], t
        assert "rank 0 called all_to_all(send=[2, 3" in t["sizes"], t
        assert "rank 1 called all_to_all(send=[2, 2" in t["sizes"] and "recv=[2, 2" in t["sizes"], t


def pairwise(comm) -> None:
    """The torch backend's pairwise point-to-point exchange, which backends without an all-to-all use."""
    from shardwise.comm import all_to_all as a2a

    a2a.METHOD_BY_BACKEND[comm.backend] = "p2p"
    for split in ("equal", "uneven"):
        _exchange(comm, split, torch.bfloat16)
        _exchange(comm, split, torch.int64, async_op=True)


def gloo_body(comm) -> dict:
    results = exercise(comm)
    results["mismatches"] = mismatches(comm)
    pairwise(comm)
    return results


def mpi_body(comm) -> dict:
    results = exercise(comm)
    results["mismatches"] = mismatches(comm)
    return results


def never_calls(comm) -> None:
    """The last rank never calls the all_to_all: it outlives the others' timeout, then returns."""
    if comm.rank == comm.size - 1:
        time.sleep(2 * comm.timeout)
        return
    comm.all_to_all([torch.empty(1) for _ in range(comm.size)], [torch.ones(1) for _ in range(comm.size)])


# ---- thread ranks ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [1, 2, 4])
def test_thread_ranks_deliver_every_message(size):
    _check_exercise(sw.launch(exercise, size), size)


def test_sub_group_of_two_out_of_four_and_a_throttled_wrapper():
    def body(comm):
        slow = Throttled(comm, bandwidth_gbps=100.0)
        pair = slow.split(0 if comm.rank in (1, 3) else None)  # world ranks 1 and 3; 0 and 2 join no group
        if pair is None:
            return None
        assert isinstance(pair, Throttled) and list(pair.global_ranks) == [1, 3]
        _exchange(pair, "uneven", torch.int64)
        _exchange(pair, "equal", async_op=True)
        return pair.stats.calls("all_to_all")

    assert sw.launch(body, 4) == [None, 2, None, 2]


def test_another_collective_raises_naming_both_calls():
    def body(comm):
        if comm.rank == 0:
            comm.all_to_all([torch.empty(2), torch.empty(2)], [torch.ones(2), torch.ones(2)])
        else:
            comm.all_gather(torch.empty(4), torch.ones(2))

    with pytest.raises(sw.LaunchError) as info:
        sw.launch(body, 2, timeout=5)
    text = str(info.value)
    assert "CommError: mismatched collectives at call #0" in text, text
    assert "all_to_all(size=2, dtype=torch.float32)" in text and "all_gather(numel=2, dtype=torch.float32)" in text


def test_shapes_that_do_not_pair_raise_naming_the_pair():
    def body(comm):
        inputs = [torch.ones(3 if comm.rank == 0 and j == 1 else 2) for j in range(2)]
        comm.all_to_all([torch.empty(2), torch.empty(2)], inputs)

    with pytest.raises(sw.LaunchError) as info:
        sw.launch(body, 2, timeout=5)
    assert "CommError" in str(info.value)
    assert "rank 0 sends inputs[1] of shape (3,) but rank 1's outputs[0] has shape (2,)" in str(info.value)


def test_a_rank_that_never_calls_raises_comm_error_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(sw.LaunchError) as info:
        sw.launch(never_calls, 3, timeout=0.3)
    assert time.monotonic() - start < 10
    assert "CommError" in str(info.value) and "all_to_all" in str(info.value) and "[2]" in str(info.value)


@pytest.mark.parametrize("outputs, inputs, match", [
    ([torch.empty(2)], [torch.ones(2), torch.ones(2)],
     r"all_to_all: outputs has 1 tensors but the group has 2 ranks; allowed: exactly one per rank"),
    ([torch.empty(2), torch.empty(2)], torch.ones(2, 2), r"all_to_all: inputs must be a list of tensors"),
    ([torch.empty(2), torch.empty(2)], [torch.ones(2), torch.ones(2, dtype=torch.float64)],
     r"several dtypes .*'torch.float32', 'torch.float64'.*allowed: one dtype for every input and output"),
    ([torch.empty(2, 2).t(), torch.empty(2)], [torch.ones(2, 2), torch.ones(2)], r"outputs\[0\] must be contiguous"),
    ([torch.empty(3), torch.empty(2)], [torch.ones(2), torch.ones(2)],
     r"inputs\[0\] \(what rank 0 sends itself\) has shape \(2,\) but outputs\[0\] has shape \(3,\)"),
])
def test_bad_arguments_raise_value_error_before_anything_is_sent(outputs, inputs, match):
    comm = ThreadWorld(2, timeout=1).communicators()[0]
    with pytest.raises(ValueError, match=match):
        comm.all_to_all(outputs, inputs)
    assert comm.stats.calls() == 0 and not comm.group.slots  # nothing counted, nothing deposited


# ---- processes -------------------------------------------------------------------------------------------------------
@pytest.mark.multiprocess
def test_gloo_four_ranks_native_and_pairwise():
    results = sw.launch(gloo_body, 4, backend="gloo", timeout=60)
    _check_exercise(results, 4)
    _check_mismatches([r["mismatches"] for r in results])


@pytest.mark.multiprocess
def test_gloo_rank_that_never_calls_raises_comm_error():
    start = time.monotonic()
    with pytest.raises(sw.LaunchError) as info:
        sw.launch(never_calls, 2, backend="gloo", timeout=2)
    assert time.monotonic() - start < 30
    assert info.value.rank == 1 and "waited 2.0s for it in all_to_all" in info.value.summary, info.value
    [(rank, error)] = info.value.others
    assert rank == 0 and error.startswith("CommError: all_to_all(send=[1, 1], recv=[1, 1]) timed out after 2s"), error
    assert "waiting for rank(s) [1]" in error, error


# MPI: mpi_body runs inside tests/test_mpi.py's one launch per world size (2 and 4 ranks; an mpirun costs seconds).
