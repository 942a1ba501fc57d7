"""A server's inbox: the next message from whichever worker sends first (receive from any source).

The Communicator's `irecv_any(tensor, tag)` is used where the backend has it (the thread backend today; MPI's
MPI_ANY_SOURCE and gloo's recvAnysource are its natural homes). A backend without it raises NotImplementedError at
the first call; the inbox then falls back to one listener thread per worker, each blocked in a plain `recv` from
its worker and handing complete messages to a queue: the classic one-handler-per-connection server (PS-lite's
van), correct on any backend whose point-to-point operations may be issued from several threads (gloo; MPI with
MPI_THREAD_MULTIPLE).

Process backends (gloo, MPI) use the listeners even where they have `irecv_any`: a receive from any source cannot
say whose connection closed, so a killed worker would only show as silence after the full timeout (while the other
workers, held at the staleness gate by the dead one, time out too); a receive from one source fails at once,
naming it. The thread backend, where a rank cannot die alone, uses `irecv_any`.

Either way a worker that dies or stays silent past the timeout is reported, not waited for: the listener's
receive raises CommError (gloo sees the connection close, or the timeout passes), and `next()` returns it as a
`Gone` event for that worker. With `irecv_any` the inbox cannot tell which silent worker is the dead one, so the
caller (the server) names the workers it is owed a message by.

A listener hands a message over as the last thing it does with it: whether it was the worker's last message is
decided first. The server, once every worker finished or was lost, `join`s the listeners, so that no listener is
still inside a torch call when the process exits: a daemon thread that comes back from C++ into an interpreter that
is finalizing is ended by a forced unwind, which a C++ frame that may not throw turns into std::terminate ("terminate
called without an active exception", SIGABRT after a job that succeeded).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Sequence

import torch

from ..comm.base import CommError, Communicator

__all__ = ["Inbox", "Message", "Gone", "Silence"]


@dataclasses.dataclass
class Message:
    source: int  # rank of the communicator
    data: torch.Tensor


@dataclasses.dataclass
class Gone:
    """A worker's receive failed (it died, or hung past the timeout): `error` says how."""

    source: int
    error: CommError


@dataclasses.dataclass
class Silence:
    """No message from any worker within the timeout (the `irecv_any` path, which cannot name one)."""

    error: CommError


class Inbox:
    """Messages of `numel` bytes (uint8) from `sources`, with tag `tag`, in arrival order."""

    def __init__(self, comm: Communicator, sources: Sequence[int], numel: int, tag: int) -> None:
        self.comm = comm
        self.sources = list(sources)
        self.numel = numel
        self.tag = tag
        self.buffer = torch.empty(numel, dtype=torch.uint8, device=comm.device)
        self.listeners: queue.Queue | None = None  # set when the fallback is in use
        self.threads: list[threading.Thread] = []
        self.closed: set[int] = set()
        if getattr(comm, "backend", "thread") != "thread":
            self._start_listeners()

    def close(self, source: int) -> None:
        """No more messages are expected from `source` (it said it finished, or it is gone)."""
        self.closed.add(source)

    def next(self, timeout: float) -> Message | Gone | Silence:
        if self.listeners is None:
            try:
                work = self.comm.irecv_any(self.buffer, self.tag)
            except NotImplementedError:
                self._start_listeners()
            else:
                try:
                    source = work.source(timeout)
                except CommError as exc:
                    return Silence(exc)
                return Message(source, self.buffer.clone())
        assert self.listeners is not None
        try:
            return self.listeners.get(timeout=timeout)
        except queue.Empty:  # every listener has its own timeout: this is only a backstop
            return Silence(CommError(f"no worker sent a message within {timeout:g}s", op="recv",
                                     rank=self.comm.rank, waited=timeout))

    def _start_listeners(self) -> None:
        self.listeners = queue.Queue()
        for source in self.sources:
            thread = threading.Thread(target=self._listen, args=(source,), daemon=True,
                                      name=f"shardwise-ps-listener-{self.comm.rank}-from-{source}")
            thread.start()
            self.threads.append(thread)

    def join(self, sources: Sequence[int], timeout: float) -> None:
        """Wait up to `timeout` seconds in all for the listeners of `sources` to end: each ends right after its
        worker's last message or a failed receive. (A worker lost by silence is not joined: its listener waits out
        its receive's own timeout.)"""
        deadline = time.monotonic() + timeout
        for source, thread in zip(self.sources, self.threads):
            if source in sources:
                thread.join(max(0.0, deadline - time.monotonic()))

    def _listen(self, source: int) -> None:
        """Receive from `source` until it is closed; a failed receive reports it gone and ends the thread."""
        assert self.listeners is not None
        while source not in self.closed:
            buffer = torch.empty(self.numel, dtype=torch.uint8, device=self.comm.device)
            try:
                self.comm.recv(buffer, source, self.tag)
            except CommError as exc:
                self.listeners.put(Gone(source, exc))
                return
            except Exception as exc:  # noqa: BLE001 - a backend error that is not (yet) a CommError: same meaning
                self.listeners.put(Gone(source, CommError(str(exc), op="recv", rank=self.comm.rank, peers=[source])))
                return
            last = self._is_last(buffer)  # before the hand-over: after it, this thread touches no tensor
            self.listeners.put(Message(source, buffer))
            if last:
                return

    @staticmethod
    def _is_last(buffer: torch.Tensor) -> bool:
        from .protocol import is_done_message

        return is_done_message(buffer)
