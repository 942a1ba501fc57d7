"""Stream-ordered collectives on CUDA, checked without a GPU: a recording stand-in for the stream API.

The torch backend is driven over a real one-rank gloo group in this process; `CommStreams` gets a `Recorder` as its
stream API (which enables the CUDA path whatever the device), and torch's Work objects are replaced by `FakeWork`s
that record how they were waited on. The checks: a collective is issued on the side stream after it waited for the
compute stream, its tensors are record_stream-ed there, `Work.wait()` is a stream wait (torch's wait without a
timeout, which is NCCL's non-blocking form, then compute waits for the side stream) and never a host wait with a
timeout; a deadline still raises CommError at the next issue; a barrier waits on the host; a CommError on NCCL aborts
the process group.
"""

from __future__ import annotations

import contextlib
import datetime
import time

import pytest
import torch
import torch.distributed as dist

from shardwise.comm import torch_backend
from shardwise.comm.base import CommError
from shardwise.comm.streams import CommStreams, PendingWork
from shardwise.comm.torch_backend import TorchCommunicator


class Recorder:
    """A stand-in for CUDA's stream API: streams are names, every call is logged in order."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.current = "compute"

    def current_stream(self, device):
        return self.current

    def new_stream(self, device):
        self.log.append(("new_stream",))
        return "comm"

    @contextlib.contextmanager
    def use(self, stream):
        self.log.append(("enter", stream))
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous
            self.log.append(("exit", stream))

    def wait_stream(self, waiter, waited):
        self.log.append(("wait_stream", waiter, waited))

    def record_stream(self, tensor, stream):
        self.log.append(("record_stream", tensor.data_ptr(), stream))


class FakeWork:
    """A torch Work that records its waits; `complete` says whether the device finished it."""

    def __init__(self, log, issued_on, complete=True):
        self.log, self.complete = log, complete
        log.append(("collective", issued_on))

    def wait(self, timeout=None):
        self.log.append(("work.wait", timeout))
        return True

    def is_completed(self):
        return self.complete


@pytest.fixture
def streamed(one_rank_world, monkeypatch):
    """A TorchCommunicator on the CUDA path (recorded streams) whose collectives return FakeWorks."""
    rec = Recorder()
    state = {"complete": True}

    def fake_all_reduce(tensor, op=None, group=None, async_op=False):
        return FakeWork(rec.log, rec.current, state["complete"])

    monkeypatch.setattr(torch_backend.dist, "all_reduce", fake_all_reduce)
    # local_if_alone=False: the one rank's collectives go to the (faked) backend, as a larger group's would
    comm = TorchCommunicator(None, timeout=0.3, _streams=CommStreams(torch.device("cpu"), api=rec),
                             local_if_alone=False)
    return comm, rec, state


def test_collective_is_issued_on_the_side_stream_after_compute_and_its_tensors_are_protected(streamed):
    comm, rec, _ = streamed
    t = torch.ones(4)
    work = comm.all_reduce(t, async_op=True)
    assert rec.log == [
        ("new_stream",),
        ("wait_stream", "comm", "compute"),  # the side stream starts after the compute queued so far
        ("enter", "comm"),
        ("collective", "comm"),  # enqueued from the side stream
        ("exit", "comm"),
        ("record_stream", t.data_ptr(), "comm"),  # the allocator keeps t's memory until the side stream ran
    ]
    rec.log.clear()
    work.wait()
    # A stream wait: torch's wait without a timeout (NCCL: the current stream waits), then compute waits for the side
    # stream. Never work.wait(timeout), which on NCCL blocks the host until the kernels end.
    assert rec.log == [("work.wait", None), ("wait_stream", "compute", "comm")]


def test_blocking_collective_is_stream_ordered_too(streamed):
    comm, rec, _ = streamed
    comm.all_reduce(torch.ones(2))
    waits = [entry for entry in rec.log if entry[0] == "work.wait"]
    assert waits == [("work.wait", None)]


def test_a_stream_waited_collective_past_its_deadline_is_a_comm_error_at_the_next_issue(streamed):
    comm, rec, state = streamed
    state["complete"] = False  # the device never finishes it: a peer is gone
    comm.all_reduce(torch.ones(3))  # returns at once: the host is not blocked
    time.sleep(0.35)
    with pytest.raises(CommError, match=r"all_reduce\(op=SUM, numel=3\) timed out after 0.3s on rank 0"):
        comm.all_reduce(torch.ones(5))


def test_barrier_waits_on_the_host_with_the_timeout(streamed):
    comm, rec, _ = streamed
    comm.barrier()
    assert [entry for entry in rec.log if entry[0] == "work.wait"] == [("work.wait", datetime.timedelta(seconds=0.3))]


def test_comm_error_on_nccl_aborts_the_process_group(one_rank_world, monkeypatch):
    aborted = []
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", lambda group=None: aborted.append(group))

    class FailingWork(FakeWork):
        def wait(self, timeout=None):
            raise RuntimeError("NCCL communicator was aborted")

    monkeypatch.setattr(torch_backend.dist, "all_reduce", lambda *a, **k: FailingWork([], "compute"))
    comm = TorchCommunicator(None, timeout=5, local_if_alone=False)  # the one rank's calls go to the backend
    comm.backend = "nccl"  # as far as the abort decision goes
    with pytest.raises(CommError, match="NCCL communicator was aborted"):
        comm.all_reduce(torch.ones(1))
    assert aborted == [None]  # the world group's communicators
    gloo = TorchCommunicator(None, timeout=5, local_if_alone=False)  # gloo needs no abort
    with pytest.raises(CommError):
        gloo.all_reduce(torch.ones(1))
    assert aborted == [None]


def test_cpu_communicators_keep_host_waits_with_a_deadline(one_rank_world):
    comm = TorchCommunicator(None, timeout=5)
    assert not comm._streams.enabled
    t = torch.ones(3)
    comm.all_reduce(t)
    assert t.tolist() == [1.0, 1.0, 1.0]


def test_pending_work_drops_what_completed_and_reports_the_oldest_overdue():
    class W:
        def __init__(self, done):
            self.done = done

        def is_completed(self):
            return self.done

    pending = PendingWork()
    pending.add(W(True), 1.0, "a")
    pending.add(W(False), 5.0, "b")
    pending.add(W(False), 2.0, "c")
    assert pending.overdue(now=1.5) is None and len(pending) == 2  # "a" completed: dropped
    assert pending.overdue(now=3.0) == "c"
    assert pending.overdue(now=6.0) == "b"
