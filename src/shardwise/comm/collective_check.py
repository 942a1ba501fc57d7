"""Mismatched collectives never pair silently on gloo and MPI: every collective is preceded by a tiny exchange of what
each rank is about to call, and a difference raises a CommError naming every rank's call.

Why. gloo pairs the n-th collective of every rank of a group whatever they are: a rank evaluating a ZeRO-3 model
alone (its all-gathers) while its peer trains (reduce-scatters of other sizes) got numbers from the wrong operation
for 35 steps before anything failed (issue 29). NCCL has the same ordering rule; shardwise's thread ranks check it
in strict mode (strict_stream.py), which is how the CPU suite catches it, but a real gloo job ran unchecked.

Mechanism. Before issuing collective k on a group, each rank all-gathers 4 int64s over the same group: (k, a hash of
the call's description, element count, dtype code). Every rank alternates descriptor, collective, descriptor, ...,
so descriptor exchanges always pair with descriptor exchanges (same size), even when the collectives that follow
them would not; the data collective is issued only after every rank's descriptor agreed (issuing it first and
checking later is not safe: gloo aborts the process when sizes differ, and the naming exchange would pair with
whatever the others do next). On a difference each rank holds all descriptors, so all raise together, after one
more exchange of the calls' text to name them: "rank 0 called all_gather(numel=18560) float32 ..., rank 1 called
reduce_scatter(op=AVG, numel=9280) float32 ...". Large collectives between ranks of one host go through the
shared-memory channel (shm_channel.py), which checks in band instead: each rank writes its call's descriptor
beside its data and compares the others' after the collective's own first barrier, before reading any data, at no
extra synchronisation. all_to_all's splits may differ per rank, so its descriptor carries a balance instead of an
element count: hashes of the shapes this rank sends to each peer minus those it expects from each. Summed over the
group it is zero only when every pair agrees (`before_all_to_all`). The idea is PyTorch's
TORCH_DISTRIBUTED_DEBUG=DETAIL (ProcessGroupWrapper, which checks on a side gloo group).

Cost: one 32-byte all-gather per collective that does not go through shared memory (its latency: 1.2 ms on this
2-core machine's loopback gloo, 1 thread per rank), and the rank waits there for the others to reach the same call;
bench/sharding.py's sw_zero3 / sw_zero3_unchecked rows measure it (docs/benchmarks.md).
`SHARDWISE_CHECK_COLLECTIVES=0` turns the exchange off (the shared-memory check, which costs nothing measurable,
stays). Point-to-point is not checked (it pairs by peer and tag, not by order), nor NCCL (its kernels are ordered
on the GPU; the descriptor exchange would be a host round trip per collective).
"""

from __future__ import annotations

import hashlib
import os
import zlib
from collections.abc import Callable, Sequence

import torch

from .base import CommError

__all__ = ["CollectiveCheck", "checks_enabled", "mismatch_message"]

_DTYPES = {dt: i for i, dt in enumerate((torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                                          torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
                                          torch.complex64, torch.complex128))}


def checks_enabled(backend: str) -> bool:
    """Whether collectives on a group of `backend` are checked (gloo and MPI, unless SHARDWISE_CHECK_COLLECTIVES=0)."""
    return backend in ("gloo", "mpi") and os.environ.get("SHARDWISE_CHECK_COLLECTIVES", "1") != "0"


_TEXT = 64  # int64 words of a call's text in the naming exchange (512 bytes)
_BALANCE = 2**62  # all_to_all's balance is summed modulo this (one int64 word per rank, no overflow)


def _pair(src: int, dst: int, shape: torch.Size) -> int:
    """The hash of "rank src sends rank dst a tensor of `shape`", as both ends compute it."""
    digest = hashlib.blake2b(f"{src}>{dst}:{tuple(shape)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % _BALANCE


class CollectiveCheck:
    """The descriptor exchange of one group (see the module docstring). `exchange(mine, everyone, what)` starts the
    backend's all-gather of small int64 tensors over the group and returns the function that waits for it (raising
    the backend's CommError for the collective `what` on failure or timeout: a peer that never comes leaves this
    rank waiting in that call, and is named as any wait of it would name it). The same-host shared-memory channel
    checks its calls in band (shm_channel.py), so its collectives skip this exchange; a rank in a shared-memory
    collective while a peer waits in this exchange (one rank's call large, the other's small) is found by the
    timeout instead, the heartbeat naming what each waits in."""

    def __init__(self, size: int, rank: int, global_ranks: Sequence[int],
                 exchange: Callable[[torch.Tensor, torch.Tensor, str], Callable[[], None]]) -> None:
        self.size = size
        self.rank = rank
        self.global_ranks = tuple(global_ranks)
        self.exchange = exchange
        self.count = 0

    def before(self, what: str, tensors: Sequence[torch.Tensor]) -> None:
        """Agree with every rank of the group on collective number `count` before it is issued; raise a CommError
        naming every rank's call when they differ."""
        if self.size == 1:
            return
        self.count += 1
        dtype = tensors[0].dtype if tensors else None
        mine = torch.tensor([self.count, zlib.crc32(what.encode()), sum(t.numel() for t in tensors),
                             -1 if dtype is None else _DTYPES.get(dtype, 99)], dtype=torch.int64)
        everyone = torch.empty(4 * self.size, dtype=torch.int64)
        self.exchange(mine, everyone, what)()
        rows = everyone.view(self.size, 4)
        if bool((rows == mine).all()):
            return
        others = [self.global_ranks[i] for i in range(self.size) if not bool((rows[i] == mine).all())]
        raise CommError(self.describe(what, dtype, rows), op=what.split("(")[0], rank=self.global_ranks[self.rank],
                        peers=others, waited=0.0)

    def before_all_to_all(self, what: str, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> None:
        """`before` for all_to_all (see the module docstring): the op and dtype must agree on every rank and the
        pairs' shapes must balance; `what` names this rank's call with its shapes."""
        if self.size == 1:
            return
        self.count += 1
        me, dtype = self.rank, inputs[0].dtype
        balance = (sum(_pair(me, j, t.shape) for j, t in enumerate(inputs))
                   - sum(_pair(i, me, t.shape) for i, t in enumerate(outputs))) % _BALANCE
        mine = torch.tensor([self.count, zlib.crc32(f"all_to_all(size={self.size})".encode()), balance,
                             _DTYPES.get(dtype, 99)], dtype=torch.int64)
        everyone = torch.empty(4 * self.size, dtype=torch.int64)
        self.exchange(mine, everyone, what)()
        rows = everyone.view(self.size, 4)
        agree = (rows[:, [0, 1, 3]] == mine[[0, 1, 3]]).all(dim=1)
        if bool(agree.all()) and sum(rows[:, 2].tolist()) % _BALANCE == 0:
            return
        # Another call: the ranks that made it; the same call with shapes that do not pair: every other rank.
        same_call = bool(agree.all())
        others = [self.global_ranks[i] for i in range(self.size) if i != me and (same_call or not bool(agree[i]))]
        text = self.describe(what, dtype, rows)
        if same_call:
            text += (" (here every rank called all_to_all with one dtype, but the shapes do not pair: rank i's "
                     "send[j] must be rank j's recv[i])")
        raise CommError(text, op="all_to_all", rank=self.global_ranks[me], peers=others, waited=0.0)

    def describe(self, what: str, dtype: torch.dtype | None, rows: torch.Tensor) -> str:
        """Every rank's call, by text: one more exchange, which every rank makes (each saw the same rows)."""
        text = f"{what} {str(dtype).removeprefix('torch.')}" if dtype is not None else what
        raw = text.encode()[: 8 * _TEXT]
        mine = torch.zeros(8 * _TEXT, dtype=torch.uint8)
        mine[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        everyone = torch.empty(_TEXT * self.size, dtype=torch.int64)
        try:
            self.exchange(mine.view(torch.int64), everyone, f"{what} [naming the calls that differ]")()
            calls = [bytes(everyone.view(torch.uint8)[i * 8 * _TEXT:(i + 1) * 8 * _TEXT].tolist()).rstrip(b"\0")
                     .decode(errors="replace") for i in range(self.size)]
        except Exception:  # noqa: BLE001 - the texts are a courtesy; the mismatch is the news
            calls = [f"a call described by hash {int(r[1])}, {int(r[2])} elements" for r in rows]
        return mismatch_message(self.global_ranks, calls, [int(n) for n in rows[:, 0]], "on this group")


def mismatch_message(global_ranks: Sequence[int], calls: Sequence[str], numbers: Sequence[int], where: str) -> str:
    """The CommError text of calls that differ across a group (this exchange's, and the shared-memory channel's)."""
    named = ", ".join(f"rank {r} called {call} (its collective #{n} {where})"
                      for r, call, n in zip(global_ranks, calls, numbers))
    return (f"collectives do not match across the group {list(global_ranks)}: {named}. Every rank must call the same "
            f"collectives in the same order (a forward of a ZeRO-3 / FSDP model, an evaluation, a state dict gather "
            f"are collectives: run them on every rank)")

