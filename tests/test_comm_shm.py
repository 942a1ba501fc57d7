"""Same-host shared-memory collectives (comm/shm_channel.py): what gloo groups on one host use for large CPU tensors.

Every check computes its expectation from the ranks' own inputs (each rank builds every rank's tensor from a seeded
generator). Three ranks, so that the general case (a rank that is neither first nor last, N-1 > 1 foreign chunks)
runs; a channel with tiny slots forces many pieces and sizes that do not divide evenly.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import shardwise as sw
from shardwise.comm.base import CommError
from shardwise.comm.shm_barrier import ordered_stores
from shardwise.comm.shm_channel import MIN_BYTES, SharedMemoryChannel

pytestmark = pytest.mark.multiprocess

DTYPES = (torch.float32, torch.bfloat16, torch.int64)


def _inputs(size: int, numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Every rank's input (small integers: sums are exact in every dtype, so results compare with torch.equal)."""
    g = torch.Generator().manual_seed(numel)
    return [torch.randint(-40, 40, (numel,), generator=g).to(dtype) for _ in range(size)]


def _reduce(parts: list[torch.Tensor], op: sw.ReduceOp) -> torch.Tensor:
    stacked = torch.stack([p.to(torch.float64) for p in parts])
    if op is sw.ReduceOp.MAX:
        return stacked.max(0).values
    if op is sw.ReduceOp.MIN:
        return stacked.min(0).values
    total = stacked.sum(0)
    return total / len(parts) if op is sw.ReduceOp.AVG else total


def _check_collectives(all_reduce, reduce_scatter, all_gather, rank: int, size: int, numel: int) -> list[str]:
    """Run every collective and op on DTYPES; return what did not match (empty: all did)."""
    wrong = []
    for dtype in DTYPES:
        ops = [sw.ReduceOp.SUM, sw.ReduceOp.MAX, sw.ReduceOp.MIN]
        if dtype.is_floating_point:
            ops.append(sw.ReduceOp.AVG)
        for op in ops:
            parts = _inputs(size, size * numel, dtype)
            want = _reduce(parts, op).to(dtype)
            mine = parts[rank].clone()
            all_reduce(mine, op)
            if not torch.equal(mine, want):
                wrong.append(f"all_reduce {dtype} {op.name}")
            out = torch.empty(numel, dtype=dtype)
            reduce_scatter(out, parts[rank].clone(), op)
            if not torch.equal(out, want[rank * numel : (rank + 1) * numel]):
                wrong.append(f"reduce_scatter {dtype} {op.name}")
            # In place: the output is this rank's own chunk of the input, as when a strategy reduces in its buffer.
            inplace = parts[rank].clone()
            reduce_scatter(inplace[rank * numel : (rank + 1) * numel], inplace, op)
            if not torch.equal(inplace[rank * numel : (rank + 1) * numel], want[rank * numel : (rank + 1) * numel]):
                wrong.append(f"reduce_scatter in place {dtype} {op.name}")
        shards = _inputs(size, numel, dtype)
        gathered = torch.empty(size * numel, dtype=dtype)
        all_gather(gathered, shards[rank])
        if not torch.equal(gathered, torch.cat(shards)):
            wrong.append(f"all_gather {dtype}")
        inplace = torch.zeros(size * numel, dtype=dtype)
        inplace[rank * numel : (rank + 1) * numel] = shards[rank]
        all_gather(inplace, inplace[rank * numel : (rank + 1) * numel])
        if not torch.equal(inplace, torch.cat(shards)):
            wrong.append(f"all_gather in place {dtype}")
    return wrong


def _through_the_communicator(comm):
    numel = 3 * MIN_BYTES  # above the threshold in every dtype: every call goes through shared memory
    wrong = _check_collectives(
        lambda t, op: comm.all_reduce(t, op),
        lambda out, inp, op: comm.reduce_scatter(out, inp, op),
        lambda out, inp: comm.all_gather(out, inp),
        comm.rank, comm.size, numel)
    # Floating-point sums of random values: bit-identical on every rank (each element is reduced by one rank).
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(comm.rank))
    comm.all_reduce(x)
    small = torch.ones(4)
    comm.all_reduce(small)  # below the threshold: gloo's sockets, same answer
    return wrong, comm.shared_memory, x, small.tolist()


def test_collectives_through_shared_memory_match_and_agree_bit_for_bit():
    results = sw.launch(_through_the_communicator, 3, backend="gloo", timeout=60)
    for wrong, shared, x, small in results:
        assert wrong == []
        assert shared is True  # one host, nobody opted out
        assert torch.equal(x, results[0][2])
        assert small == [3.0] * 4
    want = sum(torch.randn(200_000, generator=torch.Generator().manual_seed(r)).double() for r in range(3))
    assert torch.allclose(results[0][2].double(), want, atol=1e-5)


def _tiny_slots(comm, counter_barrier):
    """A channel whose slots hold 320 bytes: every collective goes in many pieces, none dividing evenly."""
    channel = SharedMemoryChannel.open(comm.group, comm.rank, tuple(range(comm.size)), 30.0, slot_bytes=320,
                                       counter_barrier=counter_barrier)
    assert channel is not None and channel.slot_bytes == 320
    comm.barrier()  # rank 0 unlinks the file right after the last step of the handshake
    left_behind = os.path.exists(channel.path)

    def all_reduce(t, op):
        channel.all_reduce(t, "SUM" if op is sw.ReduceOp.AVG else op.name).wait()
        if op is sw.ReduceOp.AVG:
            t.div_(comm.size)

    def reduce_scatter(out, inp, op):
        channel.reduce_scatter(out, inp, "SUM" if op is sw.ReduceOp.AVG else op.name).wait()
        if op is sw.ReduceOp.AVG:
            out.div_(comm.size)

    wrong = _check_collectives(all_reduce, reduce_scatter, lambda out, inp: channel.all_gather(out, inp).wait(),
                               comm.rank, comm.size, 101)
    return wrong, left_behind, channel.pieces


@pytest.mark.parametrize("counter_barrier", [
    pytest.param(True, marks=pytest.mark.skipif(not ordered_stores(), reason="the counter barrier needs x86-64")),
    False])  # False: gloo's barrier, what every other architecture uses
def test_collectives_in_many_uneven_pieces(counter_barrier):
    for wrong, left_behind, pieces in sw.launch(_tiny_slots, 3, counter_barrier, backend="gloo", timeout=60):
        assert wrong == []
        assert not left_behind  # the file was unlinked as soon as every rank had mapped it
        assert pieces > 100


def _one_rank_opts_out(comm):
    if comm.rank == 1:
        os.environ["SHARDWISE_SHM"] = "0"
    x = torch.full((MIN_BYTES,), float(comm.rank + 1))
    comm.all_reduce(x)
    return comm.shared_memory, x[:2].tolist()


def test_one_rank_opting_out_keeps_the_whole_group_on_gloo():
    for shared, values in sw.launch(_one_rank_opts_out, 2, backend="gloo", timeout=60):
        assert shared is False and values == [3.0, 3.0]


def _peer_leaves(comm):
    big = torch.ones(MIN_BYTES)
    comm.all_reduce(big)  # opens the channel on both ranks
    if comm.rank == comm.size - 1:
        return comm.shared_memory
    start = time.monotonic()
    with pytest.raises(CommError) as info:
        comm.all_reduce(big)  # the last rank never comes: the channel's barrier fails or times out
    return comm.shared_memory, str(info.value), time.monotonic() - start


def test_a_peer_that_never_comes_raises_comm_error_naming_the_operation_and_the_peer():
    results = sw.launch(_peer_leaves, 2, backend="gloo", timeout=5)
    assert results[1] is True
    shared, message, waited = results[0]
    assert shared is True and waited < 30
    assert "all_reduce" in message and "[1]" in message


def _never_opens(comm):
    if comm.rank == comm.size - 1:
        return None  # never takes part in the first large collective, whose handshake opens the channel
    with pytest.raises(CommError) as info:
        comm.all_reduce(torch.ones(MIN_BYTES))
    return str(info.value)


def test_a_peer_missing_from_the_handshake_raises_comm_error_naming_the_collective():
    message = sw.launch(_never_opens, 2, backend="gloo", timeout=5)[0]
    assert "all_reduce" in message and "shared memory" in message and "[1]" in message


def _repeated(comm, trials):
    """The tiny-slot checks `trials` times on fresh channels, with both barriers: a race shows up as a wrong value."""
    wrong = []
    for trial in range(trials):
        for counter_barrier in ([True, False] if ordered_stores() else [False]):
            result, _, _ = _tiny_slots(comm, counter_barrier)
            wrong += [f"trial {trial}: {w}" for w in result]
    return wrong


@pytest.mark.soak
@pytest.mark.parametrize("world", [2, 4])
def test_many_trials_of_uneven_pieces_stay_exact(world):
    for wrong in sw.launch(_repeated, world, 10, backend="gloo", timeout=300):
        assert wrong == []
