"""Communication streams and stream-ordered waits: how a CUDA collective overlaps compute without blocking the host.

On a GPU, "waiting" for a collective must not mean the host blocks until the kernels finished: that turns every
prefetched all-gather and every bucket all-reduce into a host synchronisation, and the overlap the strategies were
built for (ZeRO-3 prefetch, DDP buckets reduced during backward) is gone. PyTorch DDP and FSDP2 instead order
*streams* (Li et al., VLDB 2020; FSDP2's all-gather and reduce-scatter streams):

* **Issue** on a communication stream. The side stream first waits for the compute stream (`wait_stream`), so the
  inputs written by kernels queued so far are ready; the collective is then enqueued from the side stream (NCCL's
  own stream waits for the stream current at issue), and compute kernels queued later on the compute stream do not
  queue behind it. Work done inside the block (a copy-in) runs on the side stream too.
* **Protect** what crossed streams. Each tensor the collective reads or writes is `record_stream`-ed on the side
  stream: the caching allocator then does not hand its memory to a new tensor until the side stream's work queued so
  far has run, even if the Python tensor is freed at once (PyTorch's rule for tensors used on a second stream).
* **Wait** by making the compute stream wait: torch's `Work.wait()` *without* a timeout on NCCL makes the current
  stream wait for the collective (an event wait on the device), then the compute stream waits for the side stream.
  The host goes on queueing kernels. (`Work.wait(timeout)` on NCCL busy-waits on the host until the kernels end,
  which is why shardwise never passes one there.)
* **Deadlines** still hold: a stream-waited collective joins `PendingWork`, and at every later issue on that
  communicator the host checks, with a cheap event query, that none outlived shardwise's timeout; one that did is a
  CommError naming it and its peers (and the NCCL communicator is aborted so that exit cannot hang). A host wait is
  kept where the host needs the result: barriers, checkpoint I/O barriers, values read with `.item()`.

On CPU (thread, gloo, MPI) there are no streams: `CommStreams` is disabled and every wait is a host wait with a
deadline. Tests check the CUDA logic on CPU by handing `CommStreams` a recording stand-in for `StreamAPI`.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

__all__ = ["CommStreams", "PendingWork", "StreamAPI"]


class StreamAPI:
    """The handful of CUDA stream operations shardwise uses (a test substitutes a recording stand-in)."""

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def use(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def wait_stream(self, waiter: Any, waited: Any) -> None:
        """Work queued on `waiter` from now on starts after the work queued on `waited` so far (no host block)."""
        waiter.wait_stream(waited)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)


class CommStreams:
    """One communicator's side stream on its device, and the stream-ordered issue and wait of its collectives.

    device: the communicator's device; streams are enabled on CUDA devices. api: the stream operations (default the
    CUDA ones on a CUDA device, none elsewhere); passing one enables streams whatever the device (tests).
    """

    def __init__(self, device: torch.device, api: StreamAPI | None = None) -> None:
        self.device = torch.device(device)
        if api is None and self.device.type == "cuda":
            api = StreamAPI()
        self.api = api
        self._side: Any = None

    @property
    def enabled(self) -> bool:
        return self.api is not None

    def side(self) -> Any:
        """The communication stream (made on first use)."""
        if self._side is None:
            self._side = self.api.new_stream(self.device)
        return self._side

    @contextlib.contextmanager
    def issue(self, tensors: Sequence[torch.Tensor] = ()) -> Iterator[None]:
        """Enqueue the collective started inside the block on the side stream, after the compute queued so far."""
        if self.api is None:
            yield
            return
        api, side = self.api, self.side()
        api.wait_stream(side, api.current_stream(self.device))  # inputs written by compute kernels are ready
        with api.use(side):
            yield
        for tensor in tensors:  # their memory is not reused before the side stream's work has run
            api.record_stream(tensor, side)

    def wait(self, work: Any) -> None:
        """Make the current (compute) stream wait for `work` (a torch.distributed Work) and for the side stream."""
        work.wait()  # no timeout: on NCCL a stream wait, never a host wait
        self.api.wait_stream(self.api.current_stream(self.device), self.side())


class PendingWork:
    """Stream-waited collectives whose completion the host has not seen yet, oldest first, with their deadlines.

    `overdue()` drops those that completed (an event query each, no synchronisation) and returns the oldest one past
    its deadline, if any. Collectives on one communicator complete in issue order, so the queue stays short: only
    what is still running on the device.
    """

    def __init__(self) -> None:
        self._items: collections.deque[tuple[Any, float, Any]] = collections.deque()

    def add(self, work: Any, deadline: float, handle: Any) -> None:
        """Track torch Work `work` until it completes; `handle` is what `overdue` returns for it."""
        self._items.append((work, deadline, handle))

    def overdue(self, now: float | None = None) -> Any | None:
        now = time.monotonic() if now is None else now
        while self._items and self._items[0][0].is_completed():
            self._items.popleft()
        for work, deadline, handle in self._items:
            if now > deadline and not work.is_completed():
                return handle
        return None

    def __len__(self) -> int:
        return len(self._items)
