"""all_to_all: every rank sends its own tensor to every rank (torch.distributed.all_to_all's lists of tensors).

Why it exists. A mixture-of-experts layer sends each token to the experts chosen for it, and the experts live on
different ranks (expert parallelism). GShard (Lepikhin et al., 2020, arXiv 2006.16668) dispatches the tokens with
one all-to-all before the experts and brings the results back with a second one after them. Rank i's `inputs[j]`
holds the tokens it routes to rank j's experts. Their number changes from step to step, so splits are uneven:
rank i's `inputs[j]` has the shape and dtype of rank j's `outputs[i]`, and every rank allocates what it will
receive from sizes exchanged first (an all-to-all of counts, as in GShard and Megatron's token dispatcher).

Mechanism, per backend (the calls live in each backend; the shared pieces live here):
* thread: the group's collective slot (thread_backend.py) collects every rank's lists. The last rank to arrive
  checks every pair's shapes and copies rank i's `inputs[j]` into rank j's `outputs[i]`.
* gloo: ProcessGroupGloo's list all-to-all takes equal shapes only, but its all_to_all_single takes split sizes.
  The inputs are packed as bytes into one buffer, exchanged with byte split sizes, and unpacked into the outputs
  when the Work completes (one copy in, one copy out). Because they move as bytes, every dtype travels, bf16 and
  bool included.
* NCCL: torch's list all_to_all over byte views of the tensors (grouped sends and receives, no packing).
* other torch.distributed backends: pairwise point-to-point in one batch_isend_irecv. At step s = 1..N-1 rank r
  sends to r+s and receives from r-s. Every send's receive is posted in the same step, so no rank waits on a rank
  that waits on it, even when sends are unbuffered. The rank's own tensor is copied locally.
* MPI: MPI_Ialltoallv over the same packed byte buffers (mpi_backend.py).

Agreement. On gloo and MPI the collective check (collective_check.py) exchanges a descriptor of each call before
anything is sent: the op, the dtype, and a sum of hashes of the shapes this rank sends to each peer minus those it
expects from each peer. Summed over the group it is zero only when every pair agrees. When it is not zero, a
CommError names each rank's call with its shapes. On thread ranks the last rank to arrive checks every pair.

Bytes. CommStats counts the total input as the payload (like reduce_scatter's full input). It counts as wire bytes
what leaves the rank: the inputs for the other ranks, which is (N-1)/N x the total input for equal splits.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .base import Communicator, CompletedWork, Work, check_contiguous, tensor_bytes

__all__ = ["check_arguments", "record", "describe", "copy_local", "exchange_local", "pack", "unpack", "empty_bytes",
           "byte_layout", "torch_start", "METHOD_BY_BACKEND"]

OP = "all_to_all"
TAG = 0x2A2A  # the pairwise exchange's messages: apart from a user's own tag-0 point-to-point on the group
#: how the torch backend runs all_to_all per torch.distributed backend; any other backend exchanges pairwise ("p2p")
METHOD_BY_BACKEND = {"gloo": "single", "nccl": "list"}


# ---- what every backend shares ---------------------------------------------------------------------------------------
def check_arguments(comm: Communicator, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> torch.dtype:
    """Raise ValueError, before anything is sent, naming what is wrong and what is allowed; return the dtype."""
    for name, tensors in (("outputs", outputs), ("inputs", inputs)):
        if not isinstance(tensors, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in tensors):
            raise ValueError(f"{OP}: {name} must be a list of tensors, one per rank of the group "
                             f"({comm.size}); got {type(tensors).__name__}")
        if len(tensors) != comm.size:
            raise ValueError(f"{OP}: {name} has {len(tensors)} tensors but the group has {comm.size} ranks; allowed: "
                             f"exactly one per rank ({name}[j] for rank j)")
    dtypes = {t.dtype for t in (*inputs, *outputs)}
    if len(dtypes) > 1:
        raise ValueError(f"{OP}: the tensors have several dtypes (inputs {[str(t.dtype) for t in inputs]}, outputs "
                         f"{[str(t.dtype) for t in outputs]}); allowed: one dtype for every input and output")
    for i, out in enumerate(outputs):
        check_contiguous(OP, f"outputs[{i}]", out)
    me = comm.rank
    if outputs[me].shape != inputs[me].shape:
        raise ValueError(f"{OP}: inputs[{me}] (what rank {me} sends itself) has shape {tuple(inputs[me].shape)} but "
                         f"outputs[{me}] has shape {tuple(outputs[me].shape)}; they must be equal")
    return dtypes.pop() if dtypes else torch.float32


def record(comm: Communicator, inputs: Sequence[torch.Tensor]) -> None:
    """Count the call: payload the total input, wire bytes what goes to the other ranks."""
    total = sum(tensor_bytes(t) for t in inputs)
    sent = total - tensor_bytes(inputs[comm.rank]) if comm.size > 1 else 0
    comm.stats.record(OP, total, comm.size, wire=sent)


_NAMED = 16  # shapes named per list in `describe` (a 64-rank call would make a very long error message)


def _shapes(tensors: Sequence[torch.Tensor]) -> str:
    named = ["x".join(str(d) for d in t.shape) or "scalar" for t in tensors[:_NAMED]]
    more = [f"... {len(tensors) - _NAMED} more"] if len(tensors) > _NAMED else []
    return ", ".join(named + more)


def describe(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> str:
    """The call as errors name it: `all_to_all(send=[3x2, 1x2], recv=[3x2, 2x2])` (shapes per peer)."""
    return f"{OP}(send=[{_shapes(inputs)}], recv=[{_shapes(outputs)}])"


def copy_local(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], async_op: bool) -> Work | None:
    """A group of one: its own tensor, copied."""
    with torch.no_grad():
        outputs[0].copy_(inputs[0])
    return CompletedWork() if async_op else None


def exchange_local(args: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]], global_ranks: Sequence[int]) -> None:
    """The thread backend's exchange: args[r] = rank r's (outputs, inputs). Checks every pair first."""
    wrong = [f"rank {global_ranks[i]} sends inputs[{j}] of shape {tuple(ins[j].shape)} but rank {global_ranks[j]}'s "
             f"outputs[{i}] has shape {tuple(args[j][0][i].shape)}"
             for i, (_, ins) in sorted(args.items()) for j in sorted(args) if ins[j].shape != args[j][0][i].shape]
    if wrong:
        more = f" (and {len(wrong) - 4} more)" if len(wrong) > 4 else ""
        raise ValueError(f"{OP} sizes do not agree pairwise (rank i's inputs[j] must have the shape of rank j's "
                         f"outputs[i]): {'; '.join(wrong[:4])}{more}")
    # Copies first: an output may share memory with an input of this or another rank.
    sent = {(i, j): t.detach().clone() for i, (_, ins) in args.items() for j, t in enumerate(ins)}
    with torch.no_grad():
        for j, (outs, _) in args.items():
            for i, out in enumerate(outs):
                out.copy_(sent[(i, j)])


# ---- packed bytes (gloo's all_to_all_single, MPI's alltoallv) --------------------------------------------------------
def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 view (no copy; writing to it writes the tensor)."""
    return t.detach().reshape(-1).view(torch.uint8)


def pack(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The tensors' bytes, one after the other, in one uint8 buffer."""
    parts = [_bytes(t.contiguous()) for t in tensors]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)


def empty_bytes(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A uint8 buffer the size of all the tensors' bytes (what `unpack` reads from)."""
    return torch.empty(sum(tensor_bytes(t) for t in tensors), dtype=torch.uint8, device=device)


def unpack(outputs: Sequence[torch.Tensor], received: torch.Tensor) -> None:
    """Copy the packed bytes back into the (contiguous) outputs, in order."""
    offset = 0
    with torch.no_grad():
        for out in outputs:
            n = tensor_bytes(out)
            _bytes(out).copy_(received[offset : offset + n])
            offset += n


def byte_layout(tensors: Sequence[torch.Tensor]) -> tuple[list[int], list[int]]:
    """(byte counts, byte offsets) of the tensors packed one after the other."""
    counts = [tensor_bytes(t) for t in tensors]
    offsets = [sum(counts[:i]) for i in range(len(counts))]
    return counts, offsets


# ---- torch.distributed (gloo, NCCL, others) --------------------------------------------------------------------------
class _Works:
    """Several torch.distributed Works as one, with the interface the torch backend waits on."""

    def __init__(self, works: Sequence[Any]) -> None:
        self.works = list(works)

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if timeout is None:
            for w in self.works:
                w.wait()
            return True
        deadline = time.monotonic() + timeout.total_seconds()
        for w in self.works:
            left = deadline - time.monotonic()
            if w.wait(datetime.timedelta(seconds=max(left, 0.001))) is False:
                return False
        return True


def torch_start(group: Any, rank: int, global_ranks: Sequence[int], backend: str, outputs: Sequence[torch.Tensor],
                inputs: Sequence[torch.Tensor]) -> tuple[Callable[[], Any], Callable[[], None] | None,
                                                         list[torch.Tensor]]:
    """(start, finishing step, tensors the collective uses) for the torch backend's `_issue` (module docstring)."""
    import torch.distributed as dist

    method = METHOD_BY_BACKEND.get(backend, "p2p")
    device = outputs[0].device
    if method == "single":
        send, recv = pack(inputs, device), empty_bytes(outputs, device)
        send_split, recv_split = byte_layout(inputs)[0], byte_layout(outputs)[0]

        def start_single() -> Any:
            return dist.all_to_all_single(recv, send, recv_split, send_split, group=group, async_op=True)

        return start_single, lambda: unpack(outputs, recv), [send, recv, *outputs]
    sends = [_bytes(t.contiguous()) for t in inputs]
    recvs = [_bytes(o) for o in outputs]
    keep = [*sends, *recvs]
    if method == "list":
        return (lambda: dist.all_to_all(recvs, sends, group=group, async_op=True)), None, keep

    def start_pairwise() -> Any:
        recvs[rank].copy_(sends[rank])
        n, ops = len(sends), []
        for step in range(1, n):
            dst, src = (rank + step) % n, (rank - step) % n
            if sends[dst].numel():  # an empty message on both sides (the sizes agree pairwise): nothing to post
                ops.append(dist.P2POp(dist.isend, sends[dst], global_ranks[dst], group, TAG))
            if recvs[src].numel():
                ops.append(dist.P2POp(dist.irecv, recvs[src], global_ranks[src], group, TAG))
        return _Works(dist.batch_isend_irecv(ops) if ops else [])

    return start_pairwise, None, keep
