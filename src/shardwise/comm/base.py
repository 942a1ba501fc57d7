"""The Communicator protocol every backend implements, and what it shares: ReduceOp, Work, CommStats, CommError.

A Communicator is one rank's handle on a group of ranks. Strategies receive it as an argument (no global process
group anywhere in the library), so the same strategy code runs on threads in a test, on gloo processes on one
machine, and on NCCL or MPI on a cluster.

Semantics shared by every backend
---------------------------------
* Collectives are called by every rank of the group in the same order (as with MPI and torch.distributed).
* `all_reduce(t)` reduces in place. `all_gather(out, inp)` writes rank r's `inp` into
  `out[r * inp.numel():(r + 1) * inp.numel()]` (one flat output). `reduce_scatter(out, inp)` reduces the flat `inp`
  of `size * out.numel()` elements and leaves chunk `rank` in `out`. `all_to_all(outputs, inputs)` takes lists of
  `size` tensors: `inputs[j]` goes to rank j, `outputs[i]` receives rank i's `inputs[rank]` (all_to_all.py).
* `async_op=True` returns a `Work`; the tensors must not be read or written until `Work.wait()` returns.
  Without it the call blocks and returns None.
* Every wait honours the communicator's timeout (seconds) and raises `CommError` naming the operation, this rank
  and the ranks it waited for, so a dead or stuck peer is an error, never a silent hang.
* `CommStats` counts every operation's calls and payload bytes when it is issued, and the per-rank bytes a
  ring algorithm would put on the wire (see `wire_bytes`), so tests can assert a strategy's traffic against the
  textbook formula.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import enum
from collections.abc import Iterator, Sequence

import torch

__all__ = ["ReduceOp", "CommError", "Work", "CompletedWork", "OpCount", "CommStats", "Communicator", "wire_bytes",
           "is_communicator", "P2PKind", "P2POp", "AnySourceWork"]


class ReduceOp(enum.Enum):
    """How `all_reduce` and `reduce_scatter` combine the ranks' tensors. AVG is SUM divided by the group size."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"


class CommError(RuntimeError):
    """A communication operation failed or timed out: a peer died, hangs, or called a different operation.

    The message names the operation, this rank and the peer ranks involved. `op`, `rank` and `peers` carry the
    same facts as attributes for programs that handle the error; `peers` are the ranks the failed wait was for (the
    culprits, where the backend or the job's heartbeats can tell them apart), and `waited` how many seconds that wait
    lasted (None when unknown).
    """

    def __init__(self, message: str, *, op: str = "", rank: int | None = None, peers: Sequence[int] = (),
                 waited: float | None = None) -> None:
        super().__init__(message)
        self.op = op
        self.rank = rank
        self.peers = tuple(peers)
        self.waited = waited


class Work(abc.ABC):
    """Handle of an asynchronous operation. `wait()` blocks until it finished (or raises CommError on timeout)."""

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> None:
        """Block until the operation finished; `timeout` (seconds) overrides the communicator's."""

    @abc.abstractmethod
    def is_completed(self) -> bool:
        """True once the result is in place (never blocks)."""


class CompletedWork(Work):
    """A Work that is already done: what a group of one or a buffered send returns."""

    def wait(self, timeout: float | None = None) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class AnySourceWork(Work):
    """Handle of a receive-from-any-source (`Communicator.irecv_any`): `source()` waits and returns the sender."""

    @abc.abstractmethod
    def source(self, timeout: float | None = None) -> int:
        """Wait for the message; return the rank (of this group) that sent it."""


class P2PKind(enum.Enum):
    """Direction of one operation of `Communicator.batch_isend_irecv`."""

    SEND = "send"
    RECV = "recv"


@dataclasses.dataclass(frozen=True)
class P2POp:
    """One send or receive of a `batch_isend_irecv` group (torch.distributed.P2POp without a process group):
    `tensor` goes to (SEND) or comes from (RECV) rank `peer` of the communicator. Build with P2POp.send / .recv."""

    kind: P2PKind
    tensor: torch.Tensor
    peer: int
    tag: int = 0

    @classmethod
    def send(cls, tensor: torch.Tensor, dst: int, tag: int = 0) -> P2POp:
        return cls(P2PKind.SEND, tensor, dst, tag)

    @classmethod
    def recv(cls, tensor: torch.Tensor, src: int, tag: int = 0) -> P2POp:
        return cls(P2PKind.RECV, tensor, src, tag)


def wire_bytes(op: str, payload_bytes: int, group_size: int) -> int:
    """Bytes one rank sends over the wire for `op` with the ring algorithm (the textbook cost model).

    * all_reduce: reduce-scatter then all-gather around the ring, 2(N-1)/N x payload.
    * all_gather / reduce_scatter: (N-1)/N x the full (gathered / unreduced) size, which is the payload we count.
    * broadcast: a pipelined chain forwards the payload once per rank, (N-1)/N x payload averaged over ranks.
    * all_to_all: what goes to the other ranks, (N-1)/N x the total input for equal splits (uneven splits pass
      their exact count to `CommStats.record`).
    * send / recv: the payload itself, counted on the sending side only (recv counts 0 to avoid double counting).
    A group of one sends nothing.
    """
    n = group_size
    if n <= 1:
        return 0
    if op == "all_reduce":
        return 2 * (n - 1) * payload_bytes // n
    if op in ("all_gather", "reduce_scatter", "broadcast", "all_to_all"):
        return (n - 1) * payload_bytes // n
    if op == "send":
        return payload_bytes
    return 0


@dataclasses.dataclass
class OpCount:
    """Totals for one kind of operation: number of calls, payload bytes, per-rank ring wire bytes (the textbook
    cost, what the formulas and tests check), and the per-rank bytes the backend's implementation really moved
    (`transport_bytes`: more than `wire_bytes` when, e.g., gloo runs a reduce-scatter as a whole all-reduce)."""

    calls: int = 0
    bytes: int = 0
    wire_bytes: int = 0
    transport_bytes: int = 0


class CommStats:
    """Counts calls and bytes of every operation one Communicator issued.

    Payload bytes are the tensor bytes of the operation: the tensor for all_reduce and broadcast, the full gathered
    output for all_gather, the full input for reduce_scatter, the message for send/recv. `wire_bytes` is the
    per-rank ring cost (see `wire_bytes()`). Use `measure()` to count one training step:

        with comm.stats.measure() as step:
            loss.backward()
        step.wire_bytes("all_reduce")
    """

    def __init__(self) -> None:
        self.ops: dict[str, OpCount] = {}

    def record(self, op: str, payload_bytes: int, group_size: int, *, transport_bytes: int | None = None,
               wire: int | None = None) -> None:
        """Count one `op`; `transport_bytes`: what the implementation moves per rank when it is not the ring cost;
        `wire`: the textbook per-rank cost when the payload alone does not give it (an uneven all_to_all)."""
        count = self.ops.setdefault(op, OpCount())
        count.calls += 1
        count.bytes += payload_bytes
        wire = wire_bytes(op, payload_bytes, group_size) if wire is None else wire
        count.wire_bytes += wire
        count.transport_bytes += wire if transport_bytes is None else transport_bytes

    def calls(self, op: str | None = None) -> int:
        return sum(c.calls for name, c in self.ops.items() if op is None or name == op)

    def bytes(self, op: str | None = None) -> int:
        """Payload bytes of `op` (or of every operation when op is None)."""
        return sum(c.bytes for name, c in self.ops.items() if op is None or name == op)

    def wire_bytes(self, op: str | None = None) -> int:
        """Per-rank ring wire bytes of `op` (or of every operation when op is None)."""
        return sum(c.wire_bytes for name, c in self.ops.items() if op is None or name == op)

    def transport_bytes(self, op: str | None = None) -> int:
        """Per-rank bytes the backend really moved for `op` (or every operation): >= wire_bytes."""
        return sum(c.transport_bytes for name, c in self.ops.items() if op is None or name == op)

    def reset(self) -> None:
        self.ops.clear()

    def snapshot(self) -> CommStats:
        copy = CommStats()
        copy.ops = {name: dataclasses.replace(c) for name, c in self.ops.items()}
        return copy

    def since(self, earlier: CommStats) -> CommStats:
        """The operations counted after `earlier` (a snapshot) was taken."""
        delta = CommStats()
        for name, c in self.ops.items():
            before = earlier.ops.get(name, OpCount())
            d = OpCount(c.calls - before.calls, c.bytes - before.bytes, c.wire_bytes - before.wire_bytes,
                        c.transport_bytes - before.transport_bytes)
            if d.calls:
                delta.ops[name] = d
        return delta

    def merge(self, other: CommStats) -> CommStats:
        """A new CommStats holding both counts (e.g. a mesh's dp and tp traffic together)."""
        total = self.snapshot()
        for name, c in other.ops.items():
            t = total.ops.setdefault(name, OpCount())
            t.calls += c.calls
            t.bytes += c.bytes
            t.wire_bytes += c.wire_bytes
            t.transport_bytes += c.transport_bytes
        return total

    @contextlib.contextmanager
    def measure(self) -> Iterator[CommStats]:
        """Context manager yielding a CommStats that, on exit, holds only what was issued inside the block."""
        start = self.snapshot()
        result = CommStats()
        try:
            yield result
        finally:
            result.ops = self.since(start).ops

    def as_dict(self) -> dict[str, dict[str, int]]:
        """{op: {calls, bytes, wire_bytes}}: the logical counts (see `transport_bytes()` for what was moved)."""
        return {name: {"calls": c.calls, "bytes": c.bytes, "wire_bytes": c.wire_bytes}
                for name, c in sorted(self.ops.items())}

    def __repr__(self) -> str:
        return f"CommStats({self.as_dict()})"


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def check_reduce_op(name: str, op: ReduceOp, tensor: torch.Tensor) -> ReduceOp:
    if not isinstance(op, ReduceOp):
        raise ValueError(f"{name}: op={op!r} is not a ReduceOp; allowed {[o.name for o in ReduceOp]}")
    if op is ReduceOp.AVG and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"{name}: op=AVG needs a floating-point tensor, got {tensor.dtype}; use SUM")
    return op


def check_contiguous(name: str, what: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name}: {what} must be contiguous (it is written in place as one flat buffer)")


def check_color(color: int | None, key: int | None) -> None:
    if color is not None and (not isinstance(color, int) or color < 0):
        raise ValueError(f"split: color={color!r} must be a non-negative int or None")
    if key is not None and not isinstance(key, int):
        raise ValueError(f"split: key={key!r} must be an int or None")


class Communicator(abc.ABC):
    """One rank's handle on a group of ranks. See the module docstring for the semantics every backend keeps.

    Attributes: `rank` (0..size-1 within this group), `size`, `timeout` (seconds), `stats` (CommStats),
    `backend` (a short name), `global_ranks` (this group's members as ranks of the world communicator), `device`
    (where this rank's tensors live for this backend: CPU for thread, gloo and MPI; this rank's CUDA device for
    NCCL). Strategies allocate their buffers and small control tensors (flags, norms) on `comm.device`.
    """

    rank: int
    size: int
    timeout: float
    stats: CommStats
    backend: str
    global_ranks: tuple[int, ...]
    device: torch.device = torch.device("cpu")

    # ---- collectives -------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *, async_op: bool = False) -> Work | None:
        """Reduce `tensor` across the group in place."""

    @abc.abstractmethod
    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> Work | None:
        """Concatenate every rank's `input` (flattened, same numel on all ranks) into the flat `output`."""

    @abc.abstractmethod
    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *, async_op: bool = False,
        scratch_input: bool = False,
    ) -> Work | None:
        """Reduce the flat `input` (size x output.numel() elements) across ranks; keep chunk `rank` in `output`.

        scratch_input: the caller does not need `input` afterwards, so a backend may reduce in it in place (gloo
        runs an in-place all-reduce then copies the chunk, instead of cloning the input first)."""

    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, async_op: bool = False) -> Work | None:
        """Copy rank `src`'s `tensor` into every rank's `tensor` (src is a rank of this group)."""

    @abc.abstractmethod
    def all_to_all(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], *,
                   async_op: bool = False) -> Work | None:
        """Send `inputs[j]` to rank j and receive rank i's tensor for this rank in `outputs[i]` (lists of `size`
        tensors of one dtype, as torch.distributed.all_to_all; splits may be uneven: rank i's `inputs[j]` has the
        shape of rank j's `outputs[i]`). MoE token dispatch (GShard); see all_to_all.py."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Block until every rank of the group reached the barrier."""

    # ---- point to point ----------------------------------------------------------------------------------------
    @abc.abstractmethod
    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        """Start sending `tensor` to rank `dst` of this group; do not modify it until the Work completes."""

    @abc.abstractmethod
    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
        """Start receiving into `tensor` from rank `src` of this group (shape and dtype must match the send)."""

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.isend(tensor, dst, tag).wait()

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        self.irecv(tensor, src, tag).wait()

    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> list[Work]:
        """Post a group of sends and receives together; one Work per op, in order.

        This is how a step that both sends and receives must post them (NCCL's rule, kept by Megatron-LM and
        torch.distributed.pipelining): NCCL runs a pair's point-to-point on one stream, unbuffered and in issue
        order, so two ranks posting independent isend/irecv in crossed orders deadlock, while a group progresses all
        its parts at once. Messages between two ranks match in posting order (do not rely on tags: NCCL ignores
        them). Torch backends call `torch.distributed.batch_isend_irecv`; the strict thread backend fuses the group
        the same way; this default posts each op (right for MPI and buffered backends, whose operations progress
        independently)."""
        self._check_p2p_ops(ops)
        return [self.isend(o.tensor, o.peer, o.tag) if o.kind is P2PKind.SEND else self.irecv(o.tensor, o.peer, o.tag)
                for o in ops]

    def irecv_any(self, tensor: torch.Tensor, tag: int | None = None) -> AnySourceWork:
        """Start receiving into `tensor` from whichever rank sends first (MPI_ANY_SOURCE): for protocols with
        unordered arrivals, such as a parameter server. `tag`: only messages with this tag (None: any tag where the
        backend can; torch backends match tag 0). NCCL has no receive-from-any-source: its backend raises."""
        raise NotImplementedError(f"irecv_any: the {self.backend!r} backend has no receive-from-any-source")

    def recv_any(self, tensor: torch.Tensor, tag: int | None = None) -> int:
        """Receive into `tensor` from whichever rank sends first; return the sender's rank (see `irecv_any`)."""
        return self.irecv_any(tensor, tag).source()

    # ---- groups ------------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def split(self, color: int | None, key: int | None = None) -> Communicator | None:
        """Collective: partition the group by `color` (MPI_Comm_split semantics).

        Ranks passing the same color form a new communicator, ordered by `key` (default: their rank here); a rank
        passing None joins no group and gets None. Every rank of this group must call split, in the same order as
        its other collectives.
        """

    def close(self) -> None:
        """Release backend resources (a no-op for most backends)."""

    # ---- shared helpers ----------------------------------------------------------------------------------------
    def _check_p2p_ops(self, ops: Sequence[P2POp]) -> None:
        if not isinstance(ops, (list, tuple)) or not all(isinstance(o, P2POp) for o in ops):
            raise ValueError(f"batch_isend_irecv: ops={ops!r} must be a list of P2POp (P2POp.send / P2POp.recv)")
        for o in ops:
            self._check_peer("batch_isend_irecv", o.peer, "peer")

    def _check_peer(self, op: str, peer: int, what: str) -> None:
        if not isinstance(peer, int) or not 0 <= peer < self.size:
            raise ValueError(f"{op}: {what}={peer!r} is not a rank of this group; allowed 0..{self.size - 1}")

    def _check_gather_shapes(self, op: str, full: torch.Tensor, chunk: torch.Tensor) -> None:
        if full.numel() != chunk.numel() * self.size:
            name = "output" if op == "all_gather" else "input"
            raise ValueError(
                f"{op}: {name} has {full.numel()} elements but must have size x chunk = "
                f"{self.size} x {chunk.numel()} = {chunk.numel() * self.size}"
            )
        if full.dtype != chunk.dtype:
            raise ValueError(f"{op}: dtypes differ ({full.dtype} vs {chunk.dtype}); they must match")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, size={self.size}, backend={self.backend!r})"


def is_communicator(obj: object) -> bool:
    """A Communicator, or an object that acts as one (a wrapper delegating to one: tests record calls that way)."""
    return isinstance(obj, Communicator) or all(
        hasattr(obj, name) for name in ("rank", "size", "all_reduce", "all_gather", "broadcast"))
