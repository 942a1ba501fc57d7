"""N ranks as threads of one process: the backend of fast tests and of simulating large worlds.

Mechanism. Every group (the world, and each group made by `split`) keeps one *slot* per collective call, indexed by
the call's position in that group's order (each rank counts its own calls, exactly as MPI and NCCL match
collectives by order). A rank deposits its tensors in the slot and gets a Work. The last rank to arrive computes the
result for everybody, always combining contributions in rank order so results are deterministic whatever the
thread timing, writes each rank's output tensor, and wakes the waiters. An asynchronous call therefore really
overlaps: a rank may compute while its slot waits for the others. Point-to-point messages go through per
(group, src, dst, tag) mailboxes; a send copies the tensor and returns at once (a buffered send; thread_mailbox.py).

Strict mode (`ThreadWorld(n, strict=True)`, or SHARDWISE_STRICT=1, the test suite's default) models NCCL instead:
each rank's operations on a communicator run in order on one stream, point-to-point is unbuffered and untagged,
collectives must come in one order, tensors must be on comm.device, and a deadlock is reported at once
(strict_stream.py, strict_p2p.py, collective_order.py). This module delegates to them.

Failure handling. Every wait has a deadline (the communicator's timeout); on expiry it raises CommError naming the
operation, this rank and the ranks that never arrived. Ranks that call different collectives at the same position
(a bug that deadlocks real backends) all get a CommError naming both calls. `ThreadWorld.abort(reason, rank)` wakes
every waiter with a CommError naming `rank` as the peer it stopped for, which is how `launch` stops the other ranks
when one fails.

No torch.distributed here: the backend works in any PyTorch build.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import all_to_all as a2a
from . import group_of_one
from .labels import labelled
from .base import (
    AnySourceWork,
    Communicator,
    CommError,
    CommStats,
    CompletedWork,
    P2PKind,
    P2POp,
    ReduceOp,
    Work,
    check_color,
    check_contiguous,
    check_reduce_op,
    tensor_bytes,
)
from .collective_order import check_device, mismatch_message
from .strict_stream import StrictState, StrictWork, strict_default
from .thread_mailbox import AnyRecvWork, RecvWork
from .thread_world import CollectiveSlot, ThreadGroup, WorldState

__all__ = ["ThreadWorld", "ThreadCommunicator"]


def _combine(tensors: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """Reduce in rank order (deterministic), in the tensors' own dtype, as a ring would."""
    acc = tensors[0].detach().clone()
    for t in tensors[1:]:
        if op in (ReduceOp.SUM, ReduceOp.AVG):
            acc.add_(t)
        elif op is ReduceOp.MAX:
            torch.maximum(acc, t, out=acc)
        else:
            torch.minimum(acc, t, out=acc)
    if op is ReduceOp.AVG:
        acc.div_(len(tensors))
    return acc


class _SlotWork(Work):
    def __init__(self, comm: ThreadCommunicator, slot: CollectiveSlot, describe: str) -> None:
        self.comm = comm
        self.slot = slot
        self.describe = describe

    def is_completed(self) -> bool:
        return self.slot.done or self.slot.error is not None

    def wait(self, timeout: float | None = None) -> None:
        comm, slot = self.comm, self.slot
        limit = comm.timeout if timeout is None else timeout

        def timed_out() -> CommError:
            missing = [comm.global_ranks[r] for r in range(slot.size) if r not in slot.args]
            if missing:
                why = f"waiting for rank(s) {missing}, which never called it"
            else:
                why = "every rank arrived but the result was not completed"
            return CommError(
                f"{self.describe} timed out after {limit:g}s on rank {comm.global_rank}{comm.group_label()}: {why}",
                op=slot.op,
                rank=comm.global_rank,
                peers=missing,
                waited=limit,
            )

        comm.world.wait_until(lambda: slot.done or slot.error is not None, limit, timed_out, self.describe)
        if slot.error is not None:
            raise CommError(f"{slot.error} (seen on rank {comm.global_rank})", op=slot.op, rank=comm.global_rank)

    def result(self) -> Any:
        self.wait()
        return self.slot.results.get(self.comm.rank)


class ThreadWorld(WorldState):
    """`size` thread ranks sharing one state (thread_world.py); `communicators()` returns one world Communicator per
    rank. strict: NCCL's rules (strict_stream.py) or buffered, tagged point-to-point; None reads SHARDWISE_STRICT."""

    def __init__(self, size: int, timeout: float = 60.0, *, strict: bool | None = None,
                 device: torch.device | str = "cpu") -> None:
        if strict is not None and not isinstance(strict, bool):
            raise ValueError(f"ThreadWorld: strict={strict!r} must be True, False or None (None: SHARDWISE_STRICT)")
        super().__init__(size, timeout, device=device)
        on = strict_default() if strict is None else strict
        self.strict: StrictState | None = StrictState(self) if on else None

    def communicators(self) -> list[ThreadCommunicator]:
        return [ThreadCommunicator(self.world_group, r) for r in range(self.size)]


class ThreadCommunicator(Communicator):
    """One thread rank's Communicator over a group of a ThreadWorld (see the module docstring)."""

    backend = "thread"

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.world = group.world
        self.group = group
        self.rank = rank
        self.size = len(group.members)
        self.global_ranks = group.members
        self.global_rank = group.members[rank]
        self.timeout = group.world.timeout
        self.device = group.world.device
        self.stats = CommStats()
        self._next_seq = 0

    def group_label(self) -> str:
        """' (group of world ranks [...])' for a sub-communicator, '' for the world: what error messages append."""
        if self.size == self.world.size:
            return ""
        return f" (group of world ranks {list(self.global_ranks)})"

    # ---- the rendezvous ---------------------------------------------------------------------------------------
    def _collective(
        self, op: str, signature: str, arg: Any, finish: Callable[[dict[int, Any]], dict[int, Any] | None]
    ) -> _SlotWork | StrictWork:
        """Deposit `arg` in this call's slot; the last rank to arrive runs `finish(args_by_rank)` for everybody."""
        seq = self._next_seq
        self._next_seq += 1
        group, world = self.group, self.world
        with world.cond:
            slot = group.slots.get(seq)
            if slot is None:
                slot = group.slots[seq] = CollectiveSlot(op, self.size)
            call = labelled(f"{op}{signature}")
            strict = world.strict
            if strict is not None:
                strict.history(group.id).add(self.rank, seq, call)
            if slot.error is None and any(other != call for other in slot.signatures.values()):
                calls = {**slot.signatures, self.rank: call}
                if strict is not None:
                    slot.error = mismatch_message(seq, self.group_label(), calls, strict.history(group.id),
                                                  dict(enumerate(self.global_ranks)))
                else:
                    ranks = {self.global_ranks[r]: c for r, c in sorted(calls.items())}
                    slot.error = f"mismatched collectives at call #{seq}{self.group_label()}: {ranks}"
                world.cond.notify_all()
            slot.signatures[self.rank] = call
            if strict is not None:  # deposited when it reaches the head of this rank's stream
                return strict.post_collective(self, seq, slot, arg, finish, call)
            slot.args[self.rank] = arg
            complete = len(slot.args) == self.size and slot.error is None
            if complete:
                del group.slots[seq]
        if complete:
            try:
                results = finish(slot.args)
            except Exception as exc:  # a bad argument seen only when combining: report it to every rank
                with world.cond:
                    slot.error = f"{op} failed while combining: {exc!r}"
                    world.cond.notify_all()
            else:
                with world.cond:
                    slot.results = results or {}
                    slot.args = {}
                    slot.done = True
                    world.cond.notify_all()
        return _SlotWork(self, slot, f"{op}{signature}")

    def _on_device(self, op: str, *tensors: torch.Tensor) -> None:
        if self.world.strict is not None:
            for t in tensors:
                check_device(op, "the tensor", t, self.device)

    @staticmethod
    def _finish_or_wait(work: Work, async_op: bool) -> Work | None:
        if async_op:
            return work
        work.wait()
        return None

    # ---- collectives ------------------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *, async_op: bool = False) -> Work | None:
        op = check_reduce_op("all_reduce", op, tensor)
        self._on_device("all_reduce", tensor)
        self.stats.record("all_reduce", tensor_bytes(tensor), self.size)
        if self.size == 1:
            return group_of_one.unchanged(self, "all_reduce", async_op)

        def finish(args: dict[int, torch.Tensor]) -> None:
            result = _combine([args[r] for r in range(self.size)], op)
            with torch.no_grad():
                for t in args.values():
                    t.copy_(result)

        sig = f"(op={op.name}, numel={tensor.numel()}, dtype={tensor.dtype})"
        return self._finish_or_wait(self._collective("all_reduce", sig, tensor, finish), async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> Work | None:
        self._check_gather_shapes("all_gather", output, input)
        check_contiguous("all_gather", "output", output)
        self._on_device("all_gather", output, input)
        self.stats.record("all_gather", tensor_bytes(output), self.size)
        if self.size == 1:
            return group_of_one.copy(self, "all_gather", output, input, async_op)
        k = input.numel()

        def finish(args: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
            pieces = [args[r][1].reshape(-1) for r in range(self.size)]
            with torch.no_grad():
                for out, _ in args.values():
                    flat = out.view(-1)
                    for r, piece in enumerate(pieces):
                        flat[r * k : (r + 1) * k].copy_(piece)

        sig = f"(numel={k}, dtype={input.dtype})"
        return self._finish_or_wait(self._collective("all_gather", sig, (output, input), finish), async_op)

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *, async_op: bool = False,
        scratch_input: bool = False,  # the input is not reused here: nothing to gain
    ) -> Work | None:
        self._check_gather_shapes("reduce_scatter", input, output)
        op = check_reduce_op("reduce_scatter", op, input)
        self._on_device("reduce_scatter", output, input)
        self.stats.record("reduce_scatter", tensor_bytes(input), self.size)
        if self.size == 1:
            return group_of_one.copy(self, "reduce_scatter", output, input, async_op)
        k = output.numel()

        def finish(args: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
            full = _combine([args[r][1].reshape(-1) for r in range(self.size)], op)
            with torch.no_grad():
                for r, (out, _) in args.items():
                    out.view(-1).copy_(full[r * k : (r + 1) * k])

        sig = f"(op={op.name}, numel={k}, dtype={input.dtype})"
        return self._finish_or_wait(self._collective("reduce_scatter", sig, (output, input), finish), async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, async_op: bool = False) -> Work | None:
        self._check_peer("broadcast", src, "src")
        self._on_device("broadcast", tensor)
        self.stats.record("broadcast", tensor_bytes(tensor), self.size)
        if self.size == 1:
            return group_of_one.unchanged(self, "broadcast", async_op)

        def finish(args: dict[int, torch.Tensor]) -> None:
            value = args[src].detach().clone()
            with torch.no_grad():
                for r, t in args.items():
                    if r != src:
                        t.copy_(value)

        sig = f"(src={src}, numel={tensor.numel()}, dtype={tensor.dtype})"
        return self._finish_or_wait(self._collective("broadcast", sig, tensor, finish), async_op)

    def all_to_all(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], *,
                   async_op: bool = False) -> Work | None:
        """The last rank to arrive checks every pair's shapes and copies each rank's inputs (all_to_all.py)."""
        dtype = a2a.check_arguments(self, outputs, inputs)
        self._on_device("all_to_all", *outputs, *inputs)
        a2a.record(self, inputs)
        if self.size == 1:
            return a2a.copy_local(outputs, inputs, async_op)
        members = self.global_ranks
        sig = f"(size={self.size}, dtype={dtype})"  # per-pair shapes differ by rank: checked when combining
        work = self._collective("all_to_all", sig, (list(outputs), list(inputs)),
                                lambda args: a2a.exchange_local(args, members))
        return self._finish_or_wait(work, async_op)

    def barrier(self) -> None:
        self.stats.record("barrier", 0, self.size)
        if self.size > 1:
            self._collective("barrier", "()", None, lambda args: None).wait()

    # ---- point to point ---------------------------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        self._check_peer("send", dst, "dst")
        self._on_device("send", tensor)
        self.stats.record("send", tensor_bytes(tensor), self.size)
        if self.world.strict is not None:  # unbuffered: completes when the matching receive runs
            with self.world.cond:
                return self.world.strict.post_batch(self, [(True, tensor, dst, tag)])[0]
        key = (self.group.id, self.rank, dst, tag)
        with self.world.cond:
            n = self.world.sent[key]
            self.world.sent[key] += 1
            self.world.mailboxes.setdefault(key, {})[n] = (next(self.world.message_order), tensor.detach().clone())
            self.world.cond.notify_all()
        return CompletedWork()

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
        self._check_peer("recv", src, "src")
        self._on_device("recv", tensor)
        self.stats.record("recv", tensor_bytes(tensor), self.size)
        if self.world.strict is not None:
            with self.world.cond:
                return self.world.strict.post_batch(self, [(False, tensor, src, tag)])[0]
        return RecvWork(self, tensor, src, tag)

    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> list[Work]:
        """Strict mode: one fused batch on this rank's stream (strict_stream.py); otherwise buffered, one by one."""
        if self.world.strict is None:
            return super().batch_isend_irecv(ops)
        self._check_p2p_ops(ops)
        for o in ops:
            send = o.kind is P2PKind.SEND
            self._on_device("batch_isend_irecv", o.tensor)
            self.stats.record("send" if send else "recv", tensor_bytes(o.tensor), self.size)
        if not ops:
            return []
        with self.world.cond:
            return self.world.strict.post_batch(self, [(o.kind is P2PKind.SEND, o.tensor, o.peer, o.tag)
                                                       for o in ops])

    def irecv_any(self, tensor: torch.Tensor, tag: int | None = None) -> AnySourceWork:
        """Receive from whichever rank's message comes first (strict mode: the earliest posted send to this rank
        whose batch has started; otherwise the earliest buffered message); `tag` None matches any tag."""
        if tag is not None and not isinstance(tag, int):
            raise ValueError(f"recv_any: tag={tag!r} must be an int or None (any tag)")
        self._on_device("recv_any", tensor)
        self.stats.record("recv", tensor_bytes(tensor), self.size)
        if self.world.strict is not None:
            with self.world.cond:
                return self.world.strict.post_batch(self, [(False, tensor, None, tag)])[0]
        return AnyRecvWork(self, tensor, tag)

    # ---- groups -----------------------------------------------------------------------------------------------
    def split(self, color: int | None, key: int | None = None) -> ThreadCommunicator | None:
        check_color(color, key)
        my_key = self.rank if key is None else key

        def finish(args: dict[int, tuple[int | None, int]]) -> dict[int, Any]:
            results: dict[int, Any] = {r: None for r in args}
            colors = sorted({c for c, _ in args.values() if c is not None})
            for c in colors:
                ranks = sorted((r for r, (rc, _) in args.items() if rc == c), key=lambda r: (args[r][1], r))
                group = self.world.new_group(tuple(self.global_ranks[r] for r in ranks))
                for new_rank, r in enumerate(ranks):
                    results[r] = ThreadCommunicator(group, new_rank)
            return results

        if self.size == 1:
            if color is None:
                return None
            return ThreadCommunicator(self.world.new_group(self.global_ranks), 0)
        work = self._collective("split", "()", (color, my_key), finish)
        return work.result()
