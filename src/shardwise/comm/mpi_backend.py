"""Communicator over MPI through mpi4py: the backend of jobs started by mpirun / mpiexec / srun on CPU clusters.

Data path. CPU tensors go to MPI as zero-copy buffers (the tensor's address and byte length with an explicit MPI
datatype): no pickling, no copies except where a dtype or layout forces one (below). Every operation is issued in its
non-blocking form (Iallreduce, Iallgather, Ireduce_scatter_block, Ibcast, Ibarrier, Isend, Irecv); a blocking call
is the same request waited on at once, so every wait gets the same deadline handling.

Progress and timeouts. MPI has no timeouts, and Open MPI progresses a non-blocking operation only while the process
is inside an MPI call. A wait therefore polls `Request.Testall`, which both checks and drives the operation: the first
millisecond in a tight loop that yields the CPU between polls (`sched_yield`; on an oversubscribed node a rank that
spins without yielding starves the very peer it waits for), then with naps of at most 2% of the time waited so
far (capped at 1 ms), so a long wait for a slow peer neither burns a core nor slows a long transfer by more than ~2%.
While an operation issued with `async_op=True` is outstanding, a progress thread (see `_Progress`) enters MPI every
0.1-1 ms, so DDP's bucket all-reduces move during backward as they do with gloo's background threads.

Failure. When the deadline passes, the wait raises CommError naming the operation, this rank and the ranks waited
for, with what each of them answered, shortly before the deadline, when asked over a side channel (see `_Family`):
waiting in the same call, in another one, or no answer (computing, blocked elsewhere, dead). An MPI operation cannot
be cancelled, so the communicator (and every communicator split from the same world) is then unusable: later
operations raise CommError at once. The job must not outlive the error with a peer blocked forever, so when this
process exits after such an error, or after any uncaught exception, it calls `MPI_Abort` on COMM_WORLD, and mpirun
kills every rank and exits non-zero. `abort()` does it at once.

Dtypes. float32/64, int8/16/32/64, uint8, bool and complex travel with their MPI types. float16 and bfloat16 have no
reduction in MPI-3 libraries: they move as 16-bit bit patterns (all_gather, broadcast, send/recv: exact) and are
reduced (all_reduce, reduce_scatter) on a float32 copy, then rounded once to the tensor's dtype. That is as exact as
a 16-bit reduction can be, but may differ in the last bit from backends that accumulate in 16 bits.

GPU tensors go to MPI directly only when the library is CUDA-aware (Open MPI's MPIX_Query_cuda_support, MPICH's
MPIX_GPU_query_support; SHARDWISE_MPI_CUDA_AWARE=1/0 overrides). The current CUDA stream is synchronised first,
since MPI does not order itself after kernels. Otherwise the operation raises CommError advising backend="nccl".

Sub-communicators come from `split`: every rank's (color, key) is all-gathered with a deadline first, so the
blocking `MPI_Comm_split` that follows only starts once every rank has arrived.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .base import (
    Communicator,
    CommError,
    CommStats,
    ReduceOp,
    Work,
    check_color,
    check_contiguous,
    check_reduce_op,
    tensor_bytes,
)

try:
    from mpi4py import MPI
except ImportError as exc:  # pragma: no cover - exercised on machines without MPI
    raise ImportError(
        f"the mpi backend needs mpi4py and an MPI library ({exc}); install them with "
        "`apt-get install openmpi-bin libopenmpi-dev` and `pip install mpi4py==4.1.2`, or use backend='gloo'"
    ) from exc

__all__ = ["MPICommunicator", "cuda_aware_mpi", "bcast_json"]

_SPIN_S = 1e-3  # poll in a tight (yielding) loop this long before napping
_NAP_FRACTION = 0.02  # then nap at most this fraction of the time waited so far
_MAX_NAP_S = 1e-3

_TYPES = {
    torch.float32: MPI.FLOAT,
    torch.float64: MPI.DOUBLE,
    torch.int8: MPI.INT8_T,
    torch.uint8: MPI.UINT8_T,
    torch.int16: MPI.INT16_T,
    torch.int32: MPI.INT32_T,
    torch.int64: MPI.INT64_T,
    torch.bool: MPI.C_BOOL,
    torch.complex64: MPI.C_FLOAT_COMPLEX,
    torch.complex128: MPI.C_DOUBLE_COMPLEX,
}
_SIXTEEN_BIT = (torch.float16, torch.bfloat16)  # no MPI reduction: moved as int16 bits, reduced in float32
_OPS = {ReduceOp.SUM: MPI.SUM, ReduceOp.AVG: MPI.SUM, ReduceOp.MAX: MPI.MAX, ReduceOp.MIN: MPI.MIN}
_BOOL_OPS = {ReduceOp.SUM: MPI.LOR, ReduceOp.MAX: MPI.LOR, ReduceOp.MIN: MPI.LAND}


# ---- failure: what a family of communicators shares, and the process-wide abort -------------------------------------
class _Family:
    """What a world communicator and everything split from it share: whether an operation failed, CUDA-awareness,
    and a side channel (a duplicate of the root communicator) where ranks inside a wait answer "what are you in?".

    A rank about to time out asks every peer it waits for; a peer that is itself inside a shardwise wait answers
    with that operation, a peer that is computing, blocked elsewhere or dead does not. That turns "waiting for ranks
    [1, 2]" into "rank 1 waits in the same all_reduce, rank 2 did not answer" (MPI alone cannot say who is missing).
    """

    _ASK, _ANSWER, _LONGEST = 1, 2, 400

    def __init__(self, root: Any, global_ranks: Sequence[int]) -> None:
        self.failure: str | None = None
        self.cuda_aware: bool | None = None
        self.doing: tuple | None = None  # (operation, call number, group) this rank waits in; None outside waits
        self.side = root.Dup()
        self.side_rank = {g: r for r, g in enumerate(global_ranks)}  # world rank -> rank on the side channel
        self.progress = _Progress(self.side)
        self._sending: list = []

    def serve(self) -> None:
        """Answer every pending question with what this rank waits in (called while waits nap)."""
        status = MPI.Status()
        while self.side.Iprobe(source=MPI.ANY_SOURCE, tag=self._ASK, status=status):
            asker = status.Get_source()  # a rank of the side channel, answered on it
            self.side.Recv([bytearray(1), MPI.BYTE], source=asker, tag=self._ASK)
            text = "no shardwise operation"
            if self.doing is not None:
                what, seq, group = self.doing
                text = f"{what} (call #{seq} of group {list(group)})"
            answer = bytearray(text.encode()[: self._LONGEST])
            self._sending.append((self.side.Isend([answer, MPI.BYTE], dest=asker, tag=self._ANSWER), answer))
        self._sending = [(r, b) for r, b in self._sending if not r.Test()]

    def ask(self, peers: Sequence[int]) -> list:
        asked = []
        for peer in peers:
            buffer, to = bytearray(self._LONGEST), self.side_rank[peer]
            self._sending.append((self.side.Isend([bytearray(1), MPI.BYTE], dest=to, tag=self._ASK), None))
            asked.append((peer, self.side.Irecv([buffer, MPI.BYTE], source=to, tag=self._ANSWER), buffer))
        return asked

    def answers(self, asked: list) -> str:
        """', rank 1 waits in ..., rank 2 did not answer (...)': the peers' replies, as a clause of the error."""
        parts = []
        for peer, request, buffer in asked:
            status = MPI.Status()
            if request.Test(status):
                parts.append(f"rank {peer} waits in {buffer[: status.Get_count(MPI.BYTE)].decode()}")
            else:
                parts.append(f"rank {peer} did not answer (it is not in a shardwise wait: computing, blocked "
                             f"elsewhere, or dead)")
        return ": " + "; ".join(parts) if parts else ""


class _Progress:
    """A daemon thread that enters MPI while asynchronous operations of its family are outstanding.

    Open MPI advances a non-blocking operation only inside MPI calls, so without this an all-reduce that DDP issues
    during backward would not move until the next MPI call, and communication would not overlap with computation.
    While at least one `async_op=True` operation is outstanding, the thread makes a cheap MPI call (an Iprobe on the
    side channel, for a tag nobody sends) every 100 us, backing off to every 1 ms; otherwise it sleeps on a
    condition. Needs MPI_THREAD_MULTIPLE, mpi4py's default; under a lower thread level there is no thread.
    """

    _TAG = 3

    def __init__(self, side: Any) -> None:
        self.side = side
        self.outstanding = 0
        self.issued = 0
        self.stopped = False
        self.cond = threading.Condition()
        self.thread: threading.Thread | None = None
        self.enabled = MPI.Query_thread() == MPI.THREAD_MULTIPLE

    def begin(self) -> None:
        if not self.enabled:
            return
        with self.cond:
            self.outstanding += 1
            self.issued += 1
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="shardwise-mpi-progress", daemon=True)
                self.thread.start()
                _progress_threads.append(self)
            self.cond.notify()

    def end(self) -> None:
        if self.enabled:
            with self.cond:
                self.outstanding -= 1

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(1.0)

    def _run(self) -> None:
        while True:
            with self.cond:
                while self.outstanding <= 0 and not self.stopped:
                    self.cond.wait()
                if self.stopped:
                    return
            nap, seen = 1e-4, self.issued
            while self.outstanding > 0 and not self.stopped:
                self.side.Iprobe(source=MPI.ANY_SOURCE, tag=self._TAG)  # runs MPI's progress engine
                if self.issued != seen:  # a new operation: poll eagerly again
                    nap, seen = 1e-4, self.issued
                time.sleep(nap)
                nap = min(1e-3, nap * 1.25)


_failures: list[str] = []  # MPI itself is per process; so is the decision to abort it
_progress_threads: list[_Progress] = []


def _abort_at_exit() -> None:
    for progress in _progress_threads:  # no MPI call may race with MPI_Finalize
        progress.stop()
    uncaught = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if not (_failures or uncaught) or not MPI.Is_initialized() or MPI.Is_finalized():
        return
    if MPI.COMM_WORLD.Get_size() == 1:  # nobody to release
        return
    reason = _failures[0] if _failures else f"uncaught {type(uncaught).__name__}: {uncaught}"
    sys.stderr.write(f"[rank {MPI.COMM_WORLD.Get_rank()}] shardwise: aborting the MPI job after: {reason}\n")
    sys.stderr.flush()
    MPI.COMM_WORLD.Abort(1)


# Runs before mpi4py finalises MPI at exit (tests/test_mpi.py checks it): MPI_Finalize with a peer blocked in a
# collective would never return.
atexit.register(_abort_at_exit)


def cuda_aware_mpi() -> bool:
    """Whether the loaded MPI library can read and write CUDA memory (see the module docstring)."""
    override = os.environ.get("SHARDWISE_MPI_CUDA_AWARE")
    if override in ("0", "1"):
        return override == "1"
    lib = ctypes.CDLL(None)  # mpi4py loaded libmpi with global symbols
    query = getattr(lib, "MPIX_Query_cuda_support", None)  # Open MPI
    if query is not None:
        return bool(query())
    query = getattr(lib, "MPIX_GPU_query_support", None)  # MPICH: (MPIX_GPU_SUPPORT_CUDA=0, int *supported)
    if query is not None:
        supported = ctypes.c_int(0)
        return query(0, ctypes.byref(supported)) == 0 and bool(supported.value)
    return False


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


# ---- the communicator -------------------------------------------------------------------------------------------------
class MPICommunicator(Communicator):
    """A Communicator over an mpi4py communicator (default: a duplicate of COMM_WORLD, so the library's messages
    never match the application's own MPI traffic; constructing one is collective over `mpi_comm`). Build the world
    one with `shardwise.init(backend="mpi")` under mpirun / srun or `shardwise.launch(fn, n, backend="mpi")`;
    sub-communicators come from `split`.
    """

    backend = "mpi"

    def __init__(self, mpi_comm: Any = None, *, timeout: float = 60.0, _family: _Family | None = None) -> None:
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
        self._family = _Family(self.mpi_comm, self.global_ranks) if _family is None else _family
        self._calls = 0  # operations issued, named in the answer to a peer's "what are you waiting in?"

    # ---- plumbing ---------------------------------------------------------------------------------------------
    def _peers(self) -> list[int]:
        return [r for r in self.global_ranks if r != self.global_rank]

    def _fail(self, headline: str, what: str, peers: Sequence[int], tail: str = "") -> CommError:
        """Build the CommError, and mark this communicator's family unusable (see the module docstring)."""
        group = "" if self.size == MPI.COMM_WORLD.Get_size() else f" of group {list(self.global_ranks)}"
        message = f"{headline} on rank {self.global_rank}{group}, waiting for rank(s) {list(peers)}{tail}"
        self._family.failure = self._family.failure or message
        self._family.progress.stop()
        _failures.append(message)
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
        """Poll until done (see the module docstring); near the deadline ask the peers what they wait in."""
        family = self._family
        start = time.monotonic()
        deadline, ask_at = start + limit, start + limit - min(1.0, 0.2 * limit)
        asked = None
        family.doing, outer = (what, seq, self.global_ranks), family.doing
        try:
            while not self._test(requests, what, peers):
                now = time.monotonic()
                if asked is None and now >= ask_at:
                    asked = family.ask(peers)
                if now >= deadline:
                    raise self._fail(f"{what} timed out after {limit:g}s", what, peers, family.answers(asked or []) +
                                     "; MPI cannot cancel the operation, so the job is aborted when this process exits")
                waited = now - start
                if waited < _SPIN_S:
                    os.sched_yield()  # ~1 us; time.sleep(0) would nap ~60 us (the kernel's timer slack)
                else:
                    family.serve()
                    time.sleep(min(_MAX_NAP_S, waited * _NAP_FRACTION))
        finally:
            family.doing = outer

    def _issue(self, what: str, start: Callable[[], list], peers: Sequence[int], then: Callable[[], None] | None,
               keep: tuple, async_op: bool) -> Work | None:
        self._check_usable(what)
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
        """[memory, MPI datatype] over a contiguous tensor's storage, without copying (CPU) or through CUDA memory."""
        if t.dtype in _SIXTEEN_BIT:
            datatype = MPI.INT16_T
        elif t.dtype in _TYPES:
            datatype = _TYPES[t.dtype]
        else:
            raise ValueError(f"{what}: dtype {t.dtype} is not supported by the mpi backend; "
                             f"allowed {sorted(str(d) for d in (*_TYPES, *_SIXTEEN_BIT))}")
        if t.device.type == "cpu":
            # The raw address, not t.numpy(): numpy() marks the storage non-resizable for good, and ZeRO-3 frees
            # gathered parameters by resizing their storage to zero. The Work keeps `t` alive until completion.
            return [MPI.buffer.fromaddress(t.data_ptr(), t.numel() * t.element_size()), datatype]
        if t.device.type == "cuda":
            if self._family.cuda_aware is None:
                self._family.cuda_aware = cuda_aware_mpi()
            if not self._family.cuda_aware:
                raise CommError(
                    f"{what} on rank {self.global_rank}: got a CUDA tensor, but this MPI library "
                    f"({MPI.Get_library_version().splitlines()[0].strip()}) is not CUDA-aware. Use backend='nccl' for "
                    "GPU tensors (shardwise.init(backend='nccl') works under mpirun and srun), or a CUDA-aware MPI "
                    "build (SHARDWISE_MPI_CUDA_AWARE=1 forces this path)",
                    op=what.split("(")[0], rank=self.global_rank,
                )
            torch.cuda.current_stream(t.device).synchronize()  # MPI does not wait for queued kernels
            flat = t.detach().reshape(-1)
            return [flat.view(torch.int16) if t.dtype in _SIXTEEN_BIT else flat, datatype]  # via __dlpack__
        raise ValueError(f"{what}: tensors on {t.device} are not supported by the mpi backend (cpu or cuda)")

    def _reduction(self, name: str, op: ReduceOp, t: torch.Tensor) -> Any:
        op = check_reduce_op(name, op, t)
        if t.dtype == torch.bool:
            if op is ReduceOp.AVG:
                raise ValueError(f"{name}: op=AVG needs a floating-point tensor, got {t.dtype}; use SUM")
            return _BOOL_OPS[op]
        if t.is_complex() and op in (ReduceOp.MAX, ReduceOp.MIN):
            raise ValueError(f"{name}: op={op.name} is undefined for complex tensors; use SUM or AVG")
        return _OPS[op]

    # ---- collectives ------------------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *, async_op: bool = False) -> Work | None:
        native = self._reduction("all_reduce", op, tensor)
        self.stats.record("all_reduce", tensor_bytes(tensor), self.size)
        what = f"all_reduce(op={op.name}, numel={tensor.numel()})"
        # A non-contiguous or 16-bit tensor is reduced in a contiguous (float32) copy, written back on completion.
        work_t = tensor.float() if tensor.dtype in _SIXTEEN_BIT else tensor.contiguous()
        buf = self._buffer(what, work_t)
        then = _finisher(tensor, work_t, self.size if op is ReduceOp.AVG else 1)
        start = lambda: [self.mpi_comm.Iallreduce(MPI.IN_PLACE, buf, native)]  # noqa: E731
        return self._issue(what, start, self._peers(), then, (work_t, buf), async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> Work | None:
        self._check_gather_shapes("all_gather", output, input)
        check_contiguous("all_gather", "output", output)
        self.stats.record("all_gather", tensor_bytes(output), self.size)
        what = f"all_gather(numel={input.numel()})"
        send = input.contiguous()
        sbuf, rbuf = self._buffer(what, send), self._buffer(what, output)
        start = lambda: [self.mpi_comm.Iallgather(sbuf, rbuf)]  # noqa: E731
        return self._issue(what, start, self._peers(), None, (send, sbuf, rbuf), async_op)

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *, async_op: bool = False
    ) -> Work | None:
        self._check_gather_shapes("reduce_scatter", input, output)
        check_contiguous("reduce_scatter", "output", output)
        native = self._reduction("reduce_scatter", op, output)
        self.stats.record("reduce_scatter", tensor_bytes(input), self.size)
        what = f"reduce_scatter(op={op.name}, numel={output.numel()})"
        sixteen = output.dtype in _SIXTEEN_BIT
        send = input.float() if sixteen else input.contiguous()
        recv = torch.empty(output.shape, dtype=torch.float32) if sixteen else output
        sbuf, rbuf = self._buffer(what, send), self._buffer(what, recv)
        then = _finisher(output, recv, self.size if op is ReduceOp.AVG else 1)
        start = lambda: [self.mpi_comm.Ireduce_scatter_block(sbuf, rbuf, native)]  # noqa: E731
        return self._issue(what, start, self._peers(), then, (send, recv, sbuf, rbuf), async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, async_op: bool = False) -> Work | None:
        self._check_peer("broadcast", src, "src")
        self.stats.record("broadcast", tensor_bytes(tensor), self.size)
        what = f"broadcast(src={src}, numel={tensor.numel()})"
        work_t = tensor.contiguous()
        buf = self._buffer(what, work_t)
        peers = [self.global_ranks[src]] if self.rank != src else self._peers()
        start = lambda: [self.mpi_comm.Ibcast(buf, root=src)]  # noqa: E731
        return self._issue(what, start, peers, _finisher(tensor, work_t, 1), (work_t, buf), async_op)

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
        then = _finisher(tensor, recv, 1)
        return self._issue(what, start, [self.global_ranks[src]], then, (recv, buf), True)  # type: ignore[return-value]

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


def _finisher(target: torch.Tensor, staged: torch.Tensor, divide: int) -> Callable[[], None] | None:
    """The step that completes an operation staged in another tensor: divide (AVG) and copy back when needed."""
    same = staged.data_ptr() == target.data_ptr() and staged.dtype == target.dtype
    if same and divide == 1:
        return None

    def then() -> None:
        if divide != 1:
            staged.div_(divide)
        if not same:
            with torch.no_grad():
                target.copy_(staged.view(target.shape))

    return then


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
