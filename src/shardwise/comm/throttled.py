"""Throttled(comm, bandwidth_gbps=..., latency_ms=...): a Communicator that behaves as if its link were slow.

A slow-network simulator for benchmarks and tests: every operation is delegated to the wrapped communicator (so the
results are exact), then held back until `latency + wire bytes / bandwidth` after the link became free for it.
The wire bytes are the wrapped communicator's own `CommStats` count of that operation (the per-rank ring cost,
see `base.wire_bytes`), so a method that sends fewer bytes is delayed less, in exactly the proportion the cost
model says; this is what lets gradient compression's time saving be measured on one machine.

Timing model: one link per Throttled communicator, used by one operation at a time in issue order (a NIC
serializes): an operation issued at t starts at max(t, when the previous one finishes) and finishes
`latency + bytes / bandwidth` later. A synchronous call returns at its finish time; an asynchronous one returns at
once and its Work's `wait()` does not return before the finish time, so compute issued meanwhile overlaps the
"transfer" as it would on a real link. Receives are not delayed (the sender's link carries the bytes). Sub-
communicators from `split` get their own link (their own NIC share is not modelled). For a real slow link use
network namespaces and `tc netem` (docs/compression.md).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from .base import Communicator, ReduceOp, Work

__all__ = ["Throttled"]


class _DelayedWork(Work):
    def __init__(self, inner: Work | None, finish_at: float) -> None:
        self.inner = inner
        self.finish_at = finish_at

    def wait(self, timeout: float | None = None) -> None:
        if self.inner is not None:
            self.inner.wait(timeout)
        _sleep_until(self.finish_at)

    def is_completed(self) -> bool:
        return (self.inner is None or self.inner.is_completed()) and time.perf_counter() >= self.finish_at


def _sleep_until(deadline: float) -> None:
    remaining = deadline - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)


class Throttled(Communicator):
    """Wrap `comm` so that each operation takes latency_ms + wire bytes / bandwidth_gbps (see the module docstring).

    bandwidth_gbps: link bandwidth in gigabits per second (1 = 1 Gbit/s Ethernet, 0.1 = 100 Mbit/s).
    latency_ms: fixed cost per operation in milliseconds (a round trip's worth of setup; 0 allowed).
    The wrapper shares the wrapped communicator's rank, size, timeout, device and CommStats.
    """

    def __init__(self, comm: Communicator, *, bandwidth_gbps: float, latency_ms: float = 0.0) -> None:
        from .base import is_communicator

        if not is_communicator(comm):
            raise ValueError(f"Throttled: comm must be a shardwise Communicator, got {type(comm).__name__}")
        if isinstance(bandwidth_gbps, bool) or not isinstance(bandwidth_gbps, (int, float)) or not bandwidth_gbps > 0:
            raise ValueError(f"Throttled: bandwidth_gbps={bandwidth_gbps!r} must be a positive number of Gbit/s "
                             f"(e.g. 1 for 1 Gbit/s, 0.1 for 100 Mbit/s)")
        if isinstance(latency_ms, bool) or not isinstance(latency_ms, (int, float)) or not latency_ms >= 0:
            raise ValueError(f"Throttled: latency_ms={latency_ms!r} must be a number of milliseconds >= 0")
        self.inner = comm
        self.bandwidth_gbps = float(bandwidth_gbps)
        self.latency_ms = float(latency_ms)
        self.link_free_at = 0.0
        self.delayed_s = 0.0  # total simulated transfer time charged so far (for benchmarks' reports)

    # ---- the wrapped communicator's identity -------------------------------------------------------------------
    rank = property(lambda self: self.inner.rank)
    size = property(lambda self: self.inner.size)
    stats = property(lambda self: self.inner.stats)
    backend = property(lambda self: self.inner.backend)
    global_ranks = property(lambda self: self.inner.global_ranks)
    device = property(lambda self: self.inner.device)

    @property
    def timeout(self) -> float:
        return self.inner.timeout

    def seconds(self, wire_bytes: int) -> float:
        """The simulated duration of an operation that puts `wire_bytes` on this rank's link."""
        return self.latency_ms / 1e3 + wire_bytes * 8 / (self.bandwidth_gbps * 1e9)

    def _run(self, call, async_op: bool, delay: bool = True) -> Work | None:
        before = self.inner.stats.snapshot()
        issued = time.perf_counter()
        work = call()
        wire = self.inner.stats.since(before).wire_bytes()
        duration = self.seconds(wire) if delay else 0.0
        finish_at = max(issued, self.link_free_at) + duration
        self.link_free_at = finish_at
        self.delayed_s += duration
        if async_op:
            return _DelayedWork(work, finish_at)
        if work is not None:
            work.wait()
        _sleep_until(finish_at)
        return None

    # ---- collectives ------------------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *, async_op: bool = False) -> Work | None:
        return self._run(lambda: self.inner.all_reduce(tensor, op, async_op=async_op), async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> Work | None:
        return self._run(lambda: self.inner.all_gather(output, input, async_op=async_op), async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *,
                       async_op: bool = False, scratch_input: bool = False) -> Work | None:
        return self._run(lambda: self.inner.reduce_scatter(output, input, op, async_op=async_op,
                                                           scratch_input=scratch_input), async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, async_op: bool = False) -> Work | None:
        return self._run(lambda: self.inner.broadcast(tensor, src, async_op=async_op), async_op)

    def all_to_all(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], *,
                   async_op: bool = False) -> Work | None:
        return self._run(lambda: self.inner.all_to_all(outputs, inputs, async_op=async_op), async_op)

    def barrier(self) -> None:
        self.inner.barrier()
        _sleep_until(time.perf_counter() + self.latency_ms / 1e3)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        work = self._run(lambda: self.inner.isend(tensor, dst, tag), async_op=True)
        assert work is not None
        return work

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
        return self.inner.irecv(tensor, src, tag)

    def split(self, color: int | None, key: int | None = None) -> Communicator | None:
        sub = self.inner.split(color, key)
        return None if sub is None else Throttled(sub, bandwidth_gbps=self.bandwidth_gbps,
                                                  latency_ms=self.latency_ms)

    def close(self) -> None:
        self.inner.close()

    def __repr__(self) -> str:
        return f"Throttled({self.inner!r}, bandwidth_gbps={self.bandwidth_gbps:g}, latency_ms={self.latency_ms:g})"
