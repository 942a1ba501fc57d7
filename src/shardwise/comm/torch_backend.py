"""Communicator over a torch.distributed process group: gloo on CPU, NCCL on GPU (and ucc/mpi where built in).

This file, `torch_work.py` (its Work handles), `rendezvous.py` (which creates the world group), the two multi-step
collectives it runs on background threads (`gloo_ring.py`, `shm_channel.py` with `shm_barrier.py`), `all_to_all.py`
and `torch_compat.py` (names that moved between torch versions) are the only places that touch torch.distributed.
Each operation is issued with `async_op=True` and, for a blocking call, waited on at once: one code path, and every
wait gets the same timeout handling (torch_work.py), turning torch's assorted timeout and connection errors into a
CommError that names the operation, this rank and the group's ranks.

gloo has no AVG reduction: AVG is issued as SUM and divided by the group size when the Work completes. When every
rank of a gloo group is on one host, large CPU all-gathers, reduce-scatters and all-reduces go through shared memory
instead of loopback sockets (shm_channel.py; `SHARDWISE_SHM=0` turns it off).
On CUDA (NCCL) collectives are issued on the communicator's side stream and waited on the device, not the host (see
streams.py): `Work.wait()` makes the compute stream wait; a deadline is still checked at the next issue, and
`Work.wait(timeout)` with an explicit timeout (barriers) blocks the host. After a CommError on NCCL the process group
is aborted, so that neither the watchdog nor process exit waits on kernels that will never finish.

Sub-groups come from `split`, which gathers every rank's (color, key) and creates only this rank's group with
`new_group(use_local_synchronization=True)`, so a sub-communicator can itself be split without the rest of the
world taking part. Groups are cached by member list, so splitting the same way twice reuses the process group.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import all_to_all as a2a
from . import group_of_one
from .labels import IssuedOrder, labelled
from .base import (
    AnySourceWork,
    Communicator,
    CommError,
    CommStats,
    P2PKind,
    P2POp,
    ReduceOp,
    Work,
    check_color,
    check_contiguous,
    tensor_bytes,
)
from .collective_check import CollectiveCheck, checks_enabled
from .gloo_ring import GlooRing
from .group_release import track
from .heartbeat import RankWatch
from .shm_channel import SharedMemoryChannel, eligible
from .streams import CommStreams, PendingWork
from .thread_backend import ThreadCommunicator, ThreadWorld
from .torch_compat import abort_group, all_gather_flat, reduce_scatter_flat
from .torch_reduce_ops import combine_name, native_op
from .torch_work import AnySourceTorchWork, TorchWork, wait_error

__all__ = ["TorchCommunicator"]

_RELEASED = "released at leave_world"  # a released communicator's group: any later use fails at once


class TorchCommunicator(Communicator):
    """A Communicator over a torch.distributed process group (`group=None` is the default world group).

    Build the world one with `shardwise.init()` or `shardwise.launch(..., backend="gloo")`; sub-communicators
    come from `split`. Ranks given to operations (src, dst) are ranks of this group, as with every Communicator.
    `shared_memory=False` keeps this group and those split from it on gloo's sockets even on one host (the
    environment's `SHARDWISE_SHM=0` does that for every group of the process); one rank saying so is enough, the
    group decides together at its first large collective. A group of one computes its collectives locally
    (group_of_one.py); `local_if_alone=False` issues them through the backend anyway (GPU tests of NCCL's streams).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, timeout: float = 60.0, _cache: dict | None = None,
                 _watch: RankWatch | None = None, backend_timeout: float | None = None,
                 _streams: CommStreams | None = None, shared_memory: bool = True,
                 check_collectives: bool | None = None, local_if_alone: bool = True):
        if not dist.is_initialized():
            raise RuntimeError("TorchCommunicator needs torch.distributed initialised; use shardwise.init()")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.global_ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(self.size))
        self.global_rank = dist.get_rank()
        self.backend = str(dist.get_backend(group))
        self.timeout = float(timeout)
        # The process group's own timeout (NCCL's watchdog): sub-groups get the same; never below shardwise's.
        self.backend_timeout = max(self.timeout, float(backend_timeout or 0.0))
        self.stats = CommStats()
        self._alone = self.size == 1 and local_if_alone
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        self._cache: dict[tuple[int, ...], dist.ProcessGroup] = {} if _cache is None else _cache
        self._watch = _watch  # this process's heartbeat (None when the job runs none): names culprits in errors
        self._streams = CommStreams(self.device) if _streams is None else _streams  # enabled on CUDA only
        self._pending = PendingWork()  # stream-waited collectives not yet seen complete
        self._aborted = False
        self._ring: GlooRing | None = None  # gloo's ring reduce-scatter (its own group and thread), made on first use
        # Same-host shared memory for large CPU collectives on gloo (shm_channel.py): opened, collectively, on the
        # first one; False once the group found it cannot (another host, SHARDWISE_SHM=0, no /dev/shm room).
        self._shm: SharedMemoryChannel | bool | None = None
        self._shm_allowed = shared_memory  # False: this group and the groups split from it stay on sockets
        # Every rank's call agreed before each collective (collective_check.py): mismatches raise, never pair.
        # check_collectives=None: on for gloo unless SHARDWISE_CHECK_COLLECTIVES=0; False: off (bench/sharding.py
        # measures the check beside an unchecked communicator on the same group).
        checked = checks_enabled(self.backend) if check_collectives is None else check_collectives
        self._check = CollectiveCheck(self.size, self.rank, self.global_ranks, self._exchange) if checked else None
        self._order = self._check if self._check is not None else IssuedOrder()  # unchecked: hashed, compared at steps
        track(self)  # its groups are dropped at exit (group_release.py)

    def release_groups(self) -> None:
        """Drop this communicator's process groups: its own, its splits' cache, the ring's and the shared-memory
        barrier's (group_release.py). The communicator cannot communicate afterwards."""
        self.group, self._ring, self._shm = _RELEASED, None, False
        self._cache.clear()

    # ---- plumbing ---------------------------------------------------------------------------------------------
    def _error(self, what: str, limit: float, exc: BaseException | None, peers: Sequence[int] | None = None,
               began: float | None = None, start: float | None = None) -> CommError:
        """The CommError of a failed wait (torch_work.wait_error; peers default: the rest of the group), after which
        an NCCL group is aborted."""
        peers = [r for r in self.global_ranks if r != self.global_rank] if peers is None else peers
        error = wait_error(what, limit, exc, peers, global_rank=self.global_rank, global_ranks=self.global_ranks,
                           backend=self.backend, watch=self._watch, began=began, start=start)
        self._abort()
        return error

    def _work(self, work: dist.Work, what: str, then: Callable[[], None] | None, peers: Sequence[int]) -> TorchWork:
        """The handle of an issued operation, given what it needs of this communicator (torch_work.py)."""
        return TorchWork(work, what, then, peers, timeout=self.timeout, fail=self._error, streams=self._streams,
                         pending=self._pending, activity=self._watch.activity if self._watch is not None else None,
                         global_ranks=self.global_ranks)

    def _abort(self) -> None:
        """After a CommError on NCCL: abort the group's NCCL communicators. Kernels of a collective whose peer is gone
        never finish; without an abort, the next collective, the watchdog and destroy_process_group at exit all wait
        on them (PyTorch's own recovery does the same, ProcessGroupNCCL::abort). gloo and MPI need none."""
        if self.backend != "nccl" or self._aborted:
            return
        self._aborted = True
        try:
            abort_group(self.group)
        except Exception:  # noqa: BLE001 - the CommError being raised is the news; a failing abort must not hide it
            pass

    def _issue(self, what: str, start: Callable[[], dist.Work], then: Callable[[], None] | None, async_op: bool,
               peers: Sequence[int] | None = None, tensors: Sequence[torch.Tensor] = (), checked_in_band: bool = False):
        # A group collective on gloo: every rank's call agreed before it is issued (collective_check.py); the
        # shared-memory channel agrees in band, inside the collective's own first barrier (`checked_in_band`).
        if peers is None and not checked_in_band:  # all_to_all's descriptions differ by rank: it agrees its own
            self._order.before(what, tensors)
        peers = [r for r in self.global_ranks if r != self.global_rank] if peers is None else peers
        if self._streams.enabled:
            late = self._pending.overdue()
            if late is not None:  # a stream-waited collective outlived the timeout: say so before queueing more
                raise late.overdue_error()
        try:
            with self._streams.issue(tensors):
                work = start()
        except Exception as exc:
            raise self._error(what, self.timeout, exc, peers) from exc
        handle = self._work(work, what, then, peers)
        if async_op:
            return handle
        handle.wait()
        return None

    def issued_digest(self) -> int | None:
        """labels.IssuedOrder's hash where calls are not checked one by one (NCCL); None where they are."""
        return self._order.digest if isinstance(self._order, IssuedOrder) else None

    def _exchange(self, mine: torch.Tensor, everyone: torch.Tensor, what: str) -> Callable[[], None]:
        """The collective check's all-gather of small int64 tensors (CPU, gloo), straight on the group: started
        now, waited by the function returned. A failure or timeout there is the collective `what`'s (the call this
        rank was about to make is what its peers left it waiting in), named as any wait of it would be."""
        peers = [r for r in self.global_ranks if r != self.global_rank]
        try:
            work = all_gather_flat(everyone, mine, group=self.group, async_op=True)
        except Exception as exc:
            raise self._error(what, self.timeout, exc, peers) from exc
        return self._work(work, what, None, peers).wait

    @property
    def shared_memory(self) -> bool | None:
        """Whether this group's large CPU collectives go through same-host shared memory (shm_channel.py): True or
        False once its first one decided it, None before."""
        return None if self._shm is None else self._shm is not False

    def _shared_memory(self, what: str, *tensors: torch.Tensor) -> SharedMemoryChannel | None:
        """The same-host channel for a collective on `tensors`, or None (gloo's sockets carry it). The answer is the
        same on every rank: collectives agree on dtype, device and size, and the channel is opened collectively."""
        if self.backend != "gloo" or self.size == 1 or self._shm is False or not eligible(tensors):
            return None
        if self._shm is None:
            try:
                self._shm = SharedMemoryChannel.open(self.group, self.rank, self.global_ranks, self.timeout,
                                                     willing=self._shm_allowed) or False
            except Exception as exc:  # a peer gone during the handshake: the collective's own error, named
                raise self._error(f"{what} [opening same-host shared memory]", self.timeout, exc) from exc
        return self._shm or None

    # ---- collectives ------------------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *, async_op: bool = False) -> Work | None:
        native, then = native_op(op, tensor, "all_reduce", self.backend, self.size)
        self.stats.record("all_reduce", tensor_bytes(tensor), self.size)
        if self._alone:
            return group_of_one.unchanged(self, "all_reduce", async_op, tensor)
        what = labelled(f"all_reduce(op={op.name}, numel={tensor.numel()})")
        shm = self._shared_memory(what, tensor)
        if shm is not None:
            return self._issue(what, lambda: shm.all_reduce(tensor, combine_name(op), what), then, async_op,
                               checked_in_band=True)
        return self._issue(what, lambda: dist.all_reduce(tensor, native, group=self.group, async_op=True), then, async_op,
                           tensors=(tensor,))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> Work | None:
        self._check_gather_shapes("all_gather", output, input)
        check_contiguous("all_gather", "output", output)
        self.stats.record("all_gather", tensor_bytes(output), self.size)
        if self._alone:
            return group_of_one.copy(self, "all_gather", output, input, async_op)
        flat_in = input.reshape(-1)
        what = labelled(f"all_gather(numel={input.numel()})")
        shm = self._shared_memory(what, output, flat_in)
        if shm is not None:
            return self._issue(what, lambda: shm.all_gather(output, flat_in, what), None, async_op,
                               checked_in_band=True)
        start = lambda: all_gather_flat(output.view(-1), flat_in, group=self.group, async_op=True)  # noqa: E731
        return self._issue(what, start, None, async_op, tensors=(output, input))

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *, async_op: bool = False,
        scratch_input: bool = False,
    ) -> Work | None:
        self._check_gather_shapes("reduce_scatter", input, output)
        check_contiguous("reduce_scatter", "output", output)
        native, then = native_op(op, output, "reduce_scatter", self.backend, self.size)
        if self._alone:
            self.stats.record("reduce_scatter", tensor_bytes(input), self.size)
            return group_of_one.copy(self, "reduce_scatter", output, input, async_op)
        what = labelled(f"reduce_scatter(op={op.name}, numel={output.numel()})")
        shm = self._shared_memory(what, output, input)
        if shm is not None:  # reduces from the input as it is (never clones it): the ring formula's bytes
            self.stats.record("reduce_scatter", tensor_bytes(input), self.size)
            return self._issue(what, lambda: shm.reduce_scatter(output, input, combine_name(op), what), then,
                               async_op, checked_in_band=True)
        if self.backend == "gloo":
            # gloo has no reduce-scatter: reduce_scatter_tensor clones the input and all-reduces the clone, moving
            # an all-reduce's bytes (counted as transport). With a scratch input, a ring over point-to-point
            # (gloo_ring) reduces in place and moves a reduce-scatter's (N-1)/N; ops other than SUM/AVG fall back
            # to gloo's all-reduce.
            ring = scratch_input and input.is_contiguous() and native == dist.ReduceOp.SUM and self.size > 1
            moved = (1 if ring else 2) * (self.size - 1) * tensor_bytes(input) // self.size
            self.stats.record("reduce_scatter", tensor_bytes(input), self.size, transport_bytes=moved)
            if ring:
                return self._issue(what, *self._reduce_scatter_ring(output, input, then), async_op,
                                   tensors=(output, input))
        else:
            self.stats.record("reduce_scatter", tensor_bytes(input), self.size)
        flat_in = input.reshape(-1)
        start = lambda: reduce_scatter_flat(output.view(-1), flat_in, native, group=self.group, async_op=True)  # noqa: E731
        return self._issue(what, start, then, async_op, tensors=(output, input))

    def _reduce_scatter_ring(self, output: torch.Tensor, input: torch.Tensor,
                             then: Callable[[], None] | None) -> tuple[Callable[[], Any], Callable[[], None]]:
        flat, chunk = input.view(-1), output.numel()
        lo = self.rank * chunk
        if self._ring is None:
            self._ring = GlooRing(self.global_ranks, self.rank, self.timeout)

        def finish() -> None:
            output.view(-1).copy_(flat[lo : lo + chunk])
            if then is not None:
                then()  # AVG: divide the chunk

        return (lambda: self._ring.submit(flat, chunk)), finish

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, async_op: bool = False) -> Work | None:
        self._check_peer("broadcast", src, "src")
        self.stats.record("broadcast", tensor_bytes(tensor), self.size)
        if self._alone:
            return group_of_one.unchanged(self, "broadcast", async_op, tensor)
        root = self.global_ranks[src]
        what = labelled(f"broadcast(src={src}, numel={tensor.numel()})")
        return self._issue(what, lambda: dist.broadcast(tensor, root, group=self.group, async_op=True), None, async_op,
                           tensors=(tensor,))

    def all_to_all(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], *,
                   async_op: bool = False) -> Work | None:
        """gloo: all_to_all_single on packed bytes; NCCL: the list all_to_all; others: pairwise (all_to_all.py)."""
        a2a.check_arguments(self, outputs, inputs)
        a2a.record(self, inputs)
        if self.size == 1:
            return a2a.copy_local(outputs, inputs, async_op)
        what = a2a.describe(outputs, inputs)
        if self._check is not None:  # its own descriptor (uneven splits differ by rank): agreed here, not in _issue
            self._check.before_all_to_all(what, outputs, inputs)
        start, then, keep = a2a.torch_start(self.group, self.rank, self.global_ranks, self.backend, outputs, inputs)
        return self._issue(what, start, then, async_op, tensors=keep, checked_in_band=True)

    def barrier(self) -> None:
        self.stats.record("barrier", 0, self.size)
        if self._alone:
            return
        # A one-element all-reduce is a true barrier on every backend (gloo's barrier is one too) with the timeout
        # handling of the other collectives; an explicit timeout: the host waits, on CUDA too.
        flag = torch.zeros(1, device=self.device)
        work = self._issue("barrier()", lambda: dist.all_reduce(flag, group=self.group, async_op=True), None, True)
        work.wait(self.timeout)

    # ---- point to point ---------------------------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        self._check_peer("send", dst, "dst")
        self.stats.record("send", tensor_bytes(tensor), self.size)
        peer = self.global_ranks[dst]
        start = lambda: dist.isend(tensor, peer, self.group, tag)  # noqa: E731
        return self._issue(f"send(dst={dst}, tag={tag})", start, None, True, [peer])

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
        self._check_peer("recv", src, "src")
        self.stats.record("recv", tensor_bytes(tensor), self.size)
        peer = self.global_ranks[src]
        start = lambda: dist.irecv(tensor, peer, self.group, tag)  # noqa: E731
        return self._issue(f"recv(src={src}, tag={tag})", start, None, True, [peer])

    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> list[Work]:
        """torch.distributed.batch_isend_irecv: on NCCL one group (ncclGroupStart/End) whose sends and receives
        progress together, so a step that sends and receives cannot deadlock on the pair's one stream; messages
        between two ranks match in posting order (NCCL ignores tags). One Work per op, in order."""
        self._check_p2p_ops(ops)
        if not ops:
            return []
        p2p, parts = [], []
        for o in ops:
            send = o.kind is P2PKind.SEND
            self.stats.record("send" if send else "recv", tensor_bytes(o.tensor), self.size)
            p2p.append(dist.P2POp(dist.isend if send else dist.irecv, o.tensor, self.global_ranks[o.peer],
                                  self.group, o.tag))
            parts.append(f"{'send(dst' if send else 'recv(src'}={o.peer})")
        peers = sorted({self.global_ranks[o.peer] for o in ops})
        what = f"batch_isend_irecv({', '.join(parts)})"
        works: list[dist.Work] = []

        def start() -> dist.Work:
            works.extend(dist.batch_isend_irecv(p2p))
            return works[-1]

        self._issue(what, start, None, True, peers, tensors=[o.tensor for o in ops])
        return [self._work(w, what, None, peers) for w in works]

    def irecv_any(self, tensor: torch.Tensor, tag: int | None = None) -> AnySourceWork:
        """gloo's receive from any source (`irecv` with src=None); `tag` None means tag 0 (gloo matches tags).
        NCCL has no receive-from-any-source: raises ValueError (use a fixed order of receives, or gloo / MPI for
        a parameter server)."""
        if self.backend == "nccl":
            raise ValueError("recv_any: NCCL has no receive-from-any-source; post receives from known ranks in a "
                             "fixed order, or run the protocol on a gloo / MPI communicator")
        if tag is not None and not isinstance(tag, int):
            raise ValueError(f"recv_any: tag={tag!r} must be an int or None")
        self.stats.record("recv", tensor_bytes(tensor), self.size)
        others = [r for r in self.global_ranks if r != self.global_rank]
        what = f"recv_any(tag={tag})"
        work = self._issue(what, lambda: dist.irecv(tensor, None, self.group, tag or 0), None, True, others)
        return AnySourceTorchWork(work)

    # ---- groups -----------------------------------------------------------------------------------------------
    def split(self, color: int | None, key: int | None = None) -> Communicator | None:
        check_color(color, key)
        mine = torch.tensor([-1 if color is None else color, self.rank if key is None else key], dtype=torch.int64)
        everyone = torch.empty(2 * self.size, dtype=torch.int64)
        if self.device.type == "cpu":
            self.all_gather(everyone, mine)
        else:  # NCCL gathers on the GPU
            gathered = torch.empty(2 * self.size, dtype=torch.int64, device=self.device)
            self.all_gather(gathered, mine.to(self.device))
            everyone = gathered.cpu()
        pairs = everyone.view(self.size, 2).tolist()
        if color is None:
            return None
        members = sorted((r for r in range(self.size) if pairs[r][0] == color), key=lambda r: (pairs[r][1], r))
        global_members = tuple(self.global_ranks[r] for r in members)
        if len(global_members) == 1:
            # A group of one needs no process group (and new_group would be wasted work on every backend).
            single = ThreadCommunicator(ThreadWorld(1, self.timeout).new_group(global_members), 0)
            single.global_rank = self.global_rank
            return single
        if global_members == self.global_ranks and self.group is not None:
            pg = self.group
        elif global_members == tuple(range(dist.get_world_size())):
            pg = None
        else:
            pg = self._cache.get(global_members)
            if pg is None:
                pg = self._cache[global_members] = dist.new_group(
                    list(global_members), timeout=datetime.timedelta(seconds=self.backend_timeout),
                    use_local_synchronization=True)
        return TorchCommunicator(pg, timeout=self.timeout, _cache=self._cache, _watch=self._watch,
                                 backend_timeout=self.backend_timeout, shared_memory=self._shm_allowed)

