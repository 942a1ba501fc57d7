"""The parameter server's inbox on process backends: one listener thread per worker.

A listener that still runs torch code when the process exits is ended by a forced unwind that C++ turns into
std::terminate (SIGABRT after a successful job, seen on a loaded CI machine): it must be done with a message before
handing it over, and the server joins the listeners before it returns.
"""

from __future__ import annotations

import threading
import time

import torch

from shardwise.async_sgd import protocol
from shardwise.async_sgd.mailbox import Gone, Inbox, Message
from shardwise.comm.base import CommError

_BYTES = protocol.HEADER_BYTES + 8


class _GlooLike:
    """What the inbox asks of a process-backend communicator: recv from one source fills a message or raises."""

    backend = "gloo"
    device = torch.device("cpu")
    rank = 3

    def __init__(self, script: dict[int, list[int | Exception]]) -> None:
        self.script = {source: list(kinds) for source, kinds in script.items()}

    def recv(self, buffer: torch.Tensor, source: int, tag: int) -> None:
        step = self.script[source].pop(0)
        if isinstance(step, Exception):
            raise step
        protocol.encode(buffer, step, 0, 0, [torch.ones(2)], [torch.ones(2)])


def _events(inbox: Inbox, n: int) -> list[Message | Gone]:
    return [inbox.next(10.0) for _ in range(n)]


def test_a_listener_touches_no_tensor_after_handing_over_the_last_message(monkeypatch):
    inside = threading.Event()
    checked = protocol.is_done_message

    def slow_check(message: torch.Tensor) -> bool:  # a torch call the scheduler happens to make long
        inside.set()
        time.sleep(0.3)
        inside.clear()
        return checked(message)

    monkeypatch.setattr(protocol, "is_done_message", slow_check)
    inbox = Inbox(_GlooLike({0: [protocol.PUSH, protocol.DONE]}), [0], _BYTES, protocol.PUSH_TAG)
    push, done = _events(inbox, 2)
    assert isinstance(done, Message) and protocol.header(done.data)[0] == protocol.DONE
    time.sleep(0.05)
    assert not inside.is_set(), "the listener was still checking the message after the server had it"
    assert protocol.header(push.data)[0] == protocol.PUSH


def test_join_ends_the_listeners_of_finished_and_failed_workers():
    lost = CommError("recv(src=1) failed: connection closed by peer", op="recv", rank=3, peers=[1])
    inbox = Inbox(_GlooLike({0: [protocol.PUSH, protocol.DONE], 1: [lost]}), [0, 1], _BYTES, protocol.PUSH_TAG)
    events = _events(inbox, 3)
    assert sorted(type(e).__name__ for e in events) == ["Gone", "Message", "Message"]
    assert [e.source for e in events if isinstance(e, Gone)] == [1]
    inbox.join([0, 1], timeout=10.0)
    assert not any(t.is_alive() for t in inbox.threads)
    assert [t.name for t in inbox.threads] == ["shardwise-ps-listener-3-from-0", "shardwise-ps-listener-3-from-1"]


def test_join_leaves_a_silent_workers_listener_and_returns_within_its_timeout():
    release = threading.Event()

    class _Silent(_GlooLike):
        def recv(self, buffer, source, tag):
            if source == 1:
                release.wait(10.0)  # a worker alive but silent: its receive waits
                raise CommError("recv(src=1) timed out", op="recv", rank=3, peers=[1])
            super().recv(buffer, source, tag)

    inbox = Inbox(_Silent({0: [protocol.DONE]}), [0, 1], _BYTES, protocol.PUSH_TAG)
    assert isinstance(_events(inbox, 1)[0], Message)
    began = time.monotonic()
    inbox.join([0], timeout=10.0)  # the server joins only the workers that did not go silent
    assert time.monotonic() - began < 5.0
    alive = {t.name: t.is_alive() for t in inbox.threads}
    assert alive == {"shardwise-ps-listener-3-from-0": False, "shardwise-ps-listener-3-from-1": True}
    release.set()
    assert isinstance(_events(inbox, 1)[0], Gone)

