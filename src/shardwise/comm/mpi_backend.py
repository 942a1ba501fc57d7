"""Communicator over MPI through mpi4py: the backend of jobs started by mpirun / mpiexec / srun on CPU clusters.

Data path. Every operation is issued in its non-blocking form (Iallreduce, Iallgather, Ireduce_scatter_block, Ibcast,
Ibarrier, Isend, Irecv) on zero-copy buffers over the tensors' memory (mpi_buffers.py: datatypes, 16-bit floats
reduced in float32, CUDA-aware libraries). A blocking call is the same request waited on at once, so every wait
gets the same deadline handling.

Progress and timeouts. MPI has no timeouts, and Open MPI progresses a non-blocking operation only while the process
is inside an MPI call. A wait polls the requests, yielding and then napping between polls, until a deadline
(mpi_failure.py). While an operation issued with `async_op=True` is outstanding, a progress thread enters MPI every
0.1-1 ms (mpi_progress.py), so DDP's bucket all-reduces move during backward as they do with gloo's background
threads.

Failure. When the deadline passes, the wait raises CommError naming the operation, this rank and the ranks waited
for, with what each of them answered, shortly before the deadline, when asked over a side channel: waiting in the
same call, in another one, or no answer (computing, blocked elsewhere, dead). An MPI operation cannot be cancelled,
so the communicator (and every communicator split from the same world) is then unusable: later operations raise
CommError at once, and this process aborts the MPI job when it exits (mpi_failure.py). `abort()` does it at once.

Sub-communicators come from `split`: every rank's (color, key) is all-gathered with a deadline first, so the
blocking `MPI_Comm_split` that follows only starts once every rank has arrived.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import all_to_all as a2a
from .labels import IssuedOrder, labelled
from .base import (AnySourceWork, Communicator, CommError, CommStats, ReduceOp, Work, check_color, check_contiguous,
                   tensor_bytes)

try:
    from mpi4py import MPI
except ImportError as exc:  # pragma: no cover - exercised on machines without MPI
    raise ImportError(
        f"the mpi backend needs mpi4py and an MPI library ({exc}); install them with "
        "`apt-get install openmpi-bin libopenmpi-dev` and `pip install mpi4py==4.1.2`, or use backend='gloo'"
    ) from exc

# After the guarded import above, so that a missing mpi4py gets its install hint rather than a bare ImportError.
from .mpi_buffers import SIXTEEN_BIT, cuda_aware_mpi, finisher, mpi_buffer, mpi_reduction  # noqa: E402
from .mpi_failure import Family  # noqa: E402
from .collective_check import CollectiveCheck, checks_enabled  # noqa: E402

__all__ = ["MPICommunicator", "cuda_aware_mpi", "bcast_json"]


# ---- work handles -----------------------------------------------------------------------------------------------------
class _MPIWork(Work):
    """Requests of one operation, the buffers they use (kept alive until completion), and a finishing step."""

    def __init__(self, comm: MPICommunicator, requests: list, what: str, peers: Sequence[int],
                 then: Callable[[], None] | None, keep: tuple) -> None:
        self.comm = comm
        self.seq = comm._calls
        self.requests = requests
        self.what = what
        self.peers = list(peers)
        self.then = then
        self.keep = keep
        self.done = False
        self.counted = False  # whether the progress thread counts this operation as outstanding

    def _finish(self) -> None:
        if self.then is not None:
            self.then()
        self.keep = ()
        self.done = True
        if self.counted:
            self.counted = False
            self.comm._family.progress.end()

    def is_completed(self) -> bool:
        if self.done:
            return True
        self.comm._check_usable(self.what)
        if self.comm._test(self.requests, self.what, self.peers):
            self._finish()
        return self.done

    def wait(self, timeout: float | None = None) -> None:
        if self.done:
            return
        self.comm._check_usable(self.what)
        limit = self.comm.timeout if timeout is None else float(timeout)
        self.comm._wait(self.requests, self.what, self.peers, limit, self.seq)
        self._finish()


class _MPIAnySource(AnySourceWork):
    """A receive from any source: probes (MPI_Iprobe with MPI_ANY_SOURCE) until a message is there, then receives it
    from its sender with the backend's deadline-bounded irecv, so the sender is known and no wait is unbounded."""

    def __init__(self, comm: MPICommunicator, tensor: torch.Tensor, tag: int | None) -> None:
        self.comm, self.tensor, self.tag = comm, tensor, tag
        self.src: int | None = None
        self.inner: Work | None = None

    def _probe(self) -> bool:
        if self.inner is None:
            status = MPI.Status()
            tag = MPI.ANY_TAG if self.tag is None else self.tag
            if not self.comm.mpi_comm.Iprobe(source=MPI.ANY_SOURCE, tag=tag, status=status):
                return False
            self.src = status.Get_source()
            self.inner = self.comm.irecv(self.tensor, self.src, status.Get_tag())
        return True

    def is_completed(self) -> bool:
        return self._probe() and self.inner.is_completed()

    def wait(self, timeout: float | None = None) -> None:
        limit = self.comm.timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + limit
        while not self._probe():
            if time.monotonic() > deadline:
                raise self.comm._fail(f"recv_any(tag={self.tag}) timed out after {limit:g}s", "recv_any",
                                      self.comm._peers())
            time.sleep(0.0005)
        self.inner.wait(max(deadline - time.monotonic(), 0.001))

    def source(self, timeout: float | None = None) -> int:
        self.wait(timeout)
        return self.src


# ---- the communicator -------------------------------------------------------------------------------------------------
class MPICommunicator(Communicator):
    """A Communicator over an mpi4py communicator (default: a duplicate of COMM_WORLD, so the library's messages
    never match the application's own MPI traffic; constructing one is collective over `mpi_comm`). Build the world
    one with `shardwise.init(backend="mpi")` under mpirun / srun or `shardwise.launch(fn, n, backend="mpi")`;
    sub-communicators come from `split`.
    """

    backend = "mpi"

    def __init__(self, mpi_comm: Any = None, *, timeout: float = 60.0, _family: Family | None = None) -> None:
        if not timeout > 0:
            raise ValueError(f"MPICommunicator: timeout={timeout!r} must be a positive number of seconds")
        self.mpi_comm = MPI.COMM_WORLD.Dup() if mpi_comm is None else mpi_comm
        self.rank = self.mpi_comm.Get_rank()
        self.size = self.mpi_comm.Get_size()
        world = MPI.COMM_WORLD.Get_group()
        mine = self.mpi_comm.Get_group()
        self.global_ranks = tuple(int(r) for r in MPI.Group.Translate_ranks(mine, list(range(self.size)), world))
        mine.Free()
        world.Free()
        self.global_rank = MPI.COMM_WORLD.Get_rank()
        self.timeout = float(timeout)
        self.stats = CommStats()
        self.device = torch.device("cpu")
        self._family = Family(self.mpi_comm, self.global_ranks) if _family is None else _family
        self._calls = 0  # operations issued, named in the answer to a peer's "what are you waiting in?"
        # Every rank's call agreed before each collective (collective_check.py): mismatches raise, never pair.
        self._check = (CollectiveCheck(self.size, self.rank, self.global_ranks, self._exchange)
                       if checks_enabled("mpi") else None)
        self._order = self._check if self._check is not None else IssuedOrder()  # unchecked: compared at steps

    def issued_digest(self) -> int | None:
        """labels.IssuedOrder's hash where calls are not checked one by one (SHARDWISE_CHECK_COLLECTIVES=0)."""
        return self._order.digest if isinstance(self._order, IssuedOrder) else None

    # ---- plumbing ---------------------------------------------------------------------------------------------
    def _peers(self) -> list[int]:
        return [r for r in self.global_ranks if r != self.global_rank]

    def _fail(self, headline: str, what: str, peers: Sequence[int], tail: str = "") -> CommError:
        """Build the CommError, and mark this communicator's family unusable (see the module docstring)."""
        group = "" if self.size == MPI.COMM_WORLD.Get_size() else f" of group {list(self.global_ranks)}"
        message = f"{headline} on rank {self.global_rank}{group}, waiting for rank(s) {list(peers)}{tail}"
        self._family.fail(message)
        return CommError(message, op=what.split("(")[0], rank=self.global_rank, peers=peers)

    def _check_usable(self, what: str) -> None:
        if self._family.failure is not None:
            raise CommError(
                f"{what} on rank {self.global_rank}: this MPI communicator is unusable after an earlier failure "
                f"({self._family.failure})",
                op=what.split("(")[0], rank=self.global_rank, peers=self._peers(),
            )

    def _test(self, requests: list, what: str, peers: Sequence[int]) -> bool:
        try:
            return bool(MPI.Request.Testall(requests))
        except MPI.Exception as exc:
            raise self._fail(f"{what} failed ({exc.Get_error_string()})", what, peers) from exc

    def _wait(self, requests: list, what: str, peers: Sequence[int], limit: float, seq: int) -> None:
        """Poll until done or `limit` seconds pass (mpi_failure.py); then fail, with what the peers answered."""
        done = lambda: self._test(requests, what, peers)  # noqa: E731
        answers = self._family.poll(done, (what, seq, self.global_ranks), peers, limit)
        if answers is not None:
            raise self._fail(f"{what} timed out after {limit:g}s", what, peers, answers +
                             "; MPI cannot cancel the operation, so the job is aborted when this process exits")

    def _exchange(self, mine: torch.Tensor, everyone: torch.Tensor, what: str) -> Callable[[], None]:
        """The collective check's all-gather of small int64 tensors: started now, polled under the communicator's
        deadline by the function returned. A failure or timeout there is the collective `what`'s."""
        self._check_usable(what)
        self._calls += 1
        seq = self._calls
        requests = [self.mpi_comm.Iallgather([mine.numpy(), MPI.INT64_T], [everyone.numpy(), MPI.INT64_T])]
        return lambda: self._wait(requests, what, self._peers(), self.timeout, seq)

    def _issue(self, what: str, start: Callable[[], list], peers: Sequence[int], then: Callable[[], None] | None,
               keep: tuple, async_op: bool, checked: bool = False) -> Work | None:
        self._check_usable(what)
        if not checked and not what.startswith(("send(", "recv(")):  # all_to_all (checked) agrees its own
            self._order.before(what, [t for t in keep if isinstance(t, torch.Tensor)][:1])
        self._calls += 1
        try:
            requests = start()
        except MPI.Exception as exc:
            raise self._fail(f"{what} could not start ({exc.Get_error_string()})", what, peers) from exc
        work = _MPIWork(self, requests, what, peers, then, keep)
        if async_op:
            work.counted = True
            self._family.progress.begin()
            return work
        work.wait()
        return None

    def _buffer(self, what: str, t: torch.Tensor) -> list:
        """[memory, MPI datatype] over `t` (mpi_buffers.py); the library's CUDA-awareness is asked once per family."""
        if t.device.type == "cuda" and self._family.cuda_aware is None:
            self._family.cuda_aware = cuda_aware_mpi()
        return mpi_buffer(what, t, cuda_aware=bool(self._family.cuda_aware), rank=self.global_rank)

    # ---- collectives ------------------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *, async_op: bool = False) -> Work | None:
        native = mpi_reduction("all_reduce", op, tensor)
        self.stats.record("all_reduce", tensor_bytes(tensor), self.size)
        what = labelled(f"all_reduce(op={op.name}, numel={tensor.numel()})")
        # A non-contiguous or 16-bit tensor is reduced in a contiguous (float32) copy, written back on completion.
        work_t = tensor.float() if tensor.dtype in SIXTEEN_BIT else tensor.contiguous()
        buf = self._buffer(what, work_t)
        then = finisher(tensor, work_t, self.size if op is ReduceOp.AVG else 1)
        start = lambda: [self.mpi_comm.Iallreduce(MPI.IN_PLACE, buf, native)]  # noqa: E731
        return self._issue(what, start, self._peers(), then, (work_t, buf), async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> Work | None:
        self._check_gather_shapes("all_gather", output, input)
        check_contiguous("all_gather", "output", output)
        self.stats.record("all_gather", tensor_bytes(output), self.size)
        what = labelled(f"all_gather(numel={input.numel()})")
        send = input.contiguous()
        sbuf, rbuf = self._buffer(what, send), self._buffer(what, output)
        start = lambda: [self.mpi_comm.Iallgather(sbuf, rbuf)]  # noqa: E731
        return self._issue(what, start, self._peers(), None, (send, sbuf, rbuf), async_op)

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *, async_op: bool = False,
        scratch_input: bool = False,  # the input is not reused here: nothing to gain
    ) -> Work | None:
        self._check_gather_shapes("reduce_scatter", input, output)
        check_contiguous("reduce_scatter", "output", output)
        native = mpi_reduction("reduce_scatter", op, output)
        self.stats.record("reduce_scatter", tensor_bytes(input), self.size)
        what = labelled(f"reduce_scatter(op={op.name}, numel={output.numel()})")
        sixteen = output.dtype in SIXTEEN_BIT
        send = input.float() if sixteen else input.contiguous()
        recv = torch.empty(output.shape, dtype=torch.float32) if sixteen else output
        sbuf, rbuf = self._buffer(what, send), self._buffer(what, recv)
        then = finisher(output, recv, self.size if op is ReduceOp.AVG else 1)
        start = lambda: [self.mpi_comm.Ireduce_scatter_block(sbuf, rbuf, native)]  # noqa: E731
        return self._issue(what, start, self._peers(), then, (send, recv, sbuf, rbuf), async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, async_op: bool = False) -> Work | None:
        self._check_peer("broadcast", src, "src")
        self.stats.record("broadcast", tensor_bytes(tensor), self.size)
        what = labelled(f"broadcast(src={src}, numel={tensor.numel()})")
        work_t = tensor.contiguous()
        buf = self._buffer(what, work_t)
        peers = [self.global_ranks[src]] if self.rank != src else self._peers()
        start = lambda: [self.mpi_comm.Ibcast(buf, root=src)]  # noqa: E731
        return self._issue(what, start, peers, finisher(tensor, work_t, 1), (work_t, buf), async_op)

    def all_to_all(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], *,
                   async_op: bool = False) -> Work | None:
        """MPI_Ialltoallv over the inputs packed as bytes, unpacked into the outputs on completion (all_to_all.py)."""
        a2a.check_arguments(self, outputs, inputs)
        a2a.record(self, inputs)
        what = a2a.describe(outputs, inputs)
        if self._check is not None:  # its own descriptor (uneven splits differ by rank): agreed here, not in _issue
            self._check.before_all_to_all(what, outputs, inputs)
        send, recv = a2a.pack(inputs, outputs[0].device), a2a.empty_bytes(outputs, outputs[0].device)
        (smem, stype), (rmem, rtype) = self._buffer(what, send), self._buffer(what, recv)
        sspec, rspec = [smem, a2a.byte_layout(inputs), stype], [rmem, a2a.byte_layout(outputs), rtype]
        start = lambda: [self.mpi_comm.Ialltoallv(sspec, rspec)]  # noqa: E731
        return self._issue(what, start, self._peers(), lambda: a2a.unpack(outputs, recv), (send, recv, sspec, rspec),
                           async_op, checked=True)

    def barrier(self) -> None:
        self.stats.record("barrier", 0, self.size)
        self._issue("barrier()", lambda: [self.mpi_comm.Ibarrier()], self._peers(), None, (), False)

    # ---- point to point ---------------------------------------------------------------------------------------
    def _check_tag(self, op: str, tag: int) -> None:
        upper = self.mpi_comm.Get_attr(MPI.TAG_UB)
        if not isinstance(tag, int) or not 0 <= tag <= upper:
            raise ValueError(f"{op}: tag={tag!r} must be an int in 0..{upper} (MPI_TAG_UB)")

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        self._check_peer("send", dst, "dst")
        self._check_tag("send", tag)
        self.stats.record("send", tensor_bytes(tensor), self.size)
        what = f"send(dst={dst}, tag={tag})"
        send = tensor.contiguous()
        buf = self._buffer(what, send)
        start = lambda: [self.mpi_comm.Isend(buf, dest=dst, tag=tag)]  # noqa: E731
        return self._issue(what, start, [self.global_ranks[dst]], None, (send, buf), True)  # type: ignore[return-value]

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
        self._check_peer("recv", src, "src")
        self._check_tag("recv", tag)
        self.stats.record("recv", tensor_bytes(tensor), self.size)
        what = f"recv(src={src}, tag={tag})"
        recv = tensor.contiguous()
        buf = self._buffer(what, recv)
        start = lambda: [self.mpi_comm.Irecv(buf, source=src, tag=tag)]  # noqa: E731
        then = finisher(tensor, recv, 1)
        return self._issue(what, start, [self.global_ranks[src]], then, (recv, buf), True)  # type: ignore[return-value]

    def irecv_any(self, tensor: torch.Tensor, tag: int | None = None) -> AnySourceWork:
        """Receive from whichever rank's message arrives first (MPI_ANY_SOURCE; `tag` None: MPI_ANY_TAG)."""
        if tag is not None:
            self._check_tag("recv_any", tag)
        return _MPIAnySource(self, tensor, tag)

    # ---- groups -----------------------------------------------------------------------------------------------
    def split(self, color: int | None, key: int | None = None) -> Communicator | None:
        check_color(color, key)
        key = self.rank if key is None else key
        # Gather (color, key) with a deadline first: MPI_Comm_split itself blocks with no timeout.
        mine = torch.tensor([-1 if color is None else color, key], dtype=torch.int64)
        everyone = torch.empty(2 * self.size, dtype=torch.int64)
        self.all_gather(everyone, mine)
        pairs = everyone.view(self.size, 2).tolist()
        try:
            sub = self.mpi_comm.Split(MPI.UNDEFINED if color is None else color, key)
        except MPI.Exception as exc:
            raise self._fail(f"split failed ({exc.Get_error_string()})", "split", self._peers()) from exc
        if color is None:
            return None
        comm = MPICommunicator(sub, timeout=self.timeout, _family=self._family)
        members = sorted((r for r in range(self.size) if pairs[r][0] == color), key=lambda r: (pairs[r][1], r))
        assert comm.global_ranks == tuple(self.global_ranks[r] for r in members), (comm.global_ranks, members)
        return comm

    def abort(self, code: int = 1) -> None:
        """End the whole MPI job now (mpirun kills every rank and exits with a non-zero status)."""
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(code)

    def close(self) -> None:
        """Free the MPI communicator (not after a failure: its operations may still be pending)."""
        if self._family.failure is None and self.mpi_comm not in (MPI.COMM_WORLD, MPI.COMM_NULL):
            self.mpi_comm.Free()


def bcast_json(obj: Any, *, root: int = 0, timeout: float = 60.0, limit: int = 4096) -> Any:
    """Rank `root`'s JSON-serialisable `obj` on every rank of COMM_WORLD (a rendezvous address, say): no pickle."""
    comm = MPICommunicator(MPI.COMM_WORLD, timeout=timeout)
    buffer = torch.zeros(limit, dtype=torch.uint8)
    if comm.rank == root:
        payload = json.dumps(obj).encode()
        if len(payload) > limit:
            raise ValueError(f"bcast_json: {len(payload)} bytes exceed the {limit}-byte limit")
        buffer[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    comm.broadcast(buffer, src=root)
    return json.loads(buffer.numpy().tobytes().rstrip(b"\0"))
