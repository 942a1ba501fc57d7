"""PowerSGD(rank): low-rank gradient compression by one step of power iteration, with error feedback and warm start
(Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization",
NeurIPS 2019, arXiv 1905.13727; PyTorch's `powerSGD_hook`).

Mechanism, per bucket and step on each rank (Algorithms 1 and 2 of the paper):
* Each tensor of the bucket with 2+ dims is viewed as a matrix M (n = shape[0] rows, m = the rest). It is compressed
  at rank r = min(rank, n, m) only if that shrinks it enough: n x m > (n + m) x r x min_compression_rate. The
  others (1-D biases and norms, small matrices) are **batched into one flat all-reduce**, uncompressed, exact.
* M = gradient + memory (error feedback). P = M Q, with Q (m x r) from the previous step (warm start: one more
  power-iteration step on a slowly changing gradient) or, the first time or without warm start, drawn from a
  generator seeded identically on every rank.
* All P's of the bucket go in **one all-reduce** (sum); each P is orthogonalized (reduced QR: an orthonormal basis
  P^ of its column span, robust when the span is rank-deficient); Q = M^T P^ locally; the error is
  M - P^ Q^T (what this rank's own approximation misses, as in the paper); all Q's go in **one all-reduce**
  (averaged). The bucket becomes P^ Q^T = P^ P^^T avg(M): every rank gets the same rank-r approximation of the
  average gradient, and the averaged Q is the next step's warm start (identical on every rank).
* The first `start_iter` reductions of each bucket are plain fp32 all-reduces (the paper's and PyTorch's warm-up:
  early gradients change fast, and low-rank compression there costs accuracy).
* At rank = min(n, m) the basis P^ spans avg(M)'s column space, so the result equals the uncompressed average
  (each rank's error is nonzero, but the errors sum to zero over ranks).
The first all-reduces (P's and the uncompressed batch) are issued when the bucket is ready, so they overlap
backward like DDP's; orthogonalization, the Q all-reduce and decompression run when the strategy waits, and the
Q all-reduce overlaps the computation of this rank's error.

CPU cost (what decides the step time once the bytes are few; measured against torch's hook in docs/compression.md):
the bucket itself is the working matrix (the residual is added in place, the result written back over it, so no
copy of the bucket is made); P, Q and the residual live in buffers allocated once per bucket (fresh megabyte tensors
every step cost page faults); same-shape matrices are grouped, so one batched QR orthogonalizes a group's P's; the
error is one fused `addmm` per matrix ((M - P Q^T) / loss scale: the residual is kept in gradient units).

A skipped step leaves the residual and the warm-start Q as they were (transaction.py): the averaged Q and the residual
each alternate between two buffers, and a step writes into the one the state before it does not hold, so restoring
is a matter of references. Cost: one more residual-sized buffer per bucket than a single in-place residual would
need (and two more Q-sized ones, small).

Bytes on the wire per bucket (a compressing step): 2(N-1)/N x 4 x (sum n r + sum m r + uncompressed numel) per
rank, in two or three all-reduces.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from ..comm.base import Communicator, ReduceOp, Work
from .base import (Compressor, Payload, PendingWork, Shapes, check_start_iter, ring_all_reduce, shared_generator, tile,
                   total_numel)

__all__ = ["PowerSGD"]


class _Group:
    """Same-shape compressed matrices of a bucket: (n, m, r), and per matrix where it starts in the bucket, in the
    bucket's Q and in its error-feedback memory (those two in bucket order, as saved in checkpoints). Their P's are
    consecutive in the P buffer, from `p_start`, so that one batched QR orthogonalizes the whole group."""

    def __init__(self, n: int, m: int, r: int) -> None:
        self.n, self.m, self.r = n, m, r
        self.offsets: list[int] = []
        self.q_starts: list[int] = []
        self.e_starts: list[int] = []
        self.p_start = 0


class _Plan:
    """Which tensors of a bucket are compressed (offset, n, m, r), grouped by shape, and which are batched
    uncompressed (offset, numel)."""

    def __init__(self, shapes: Shapes | None, numel: int, rank: int, min_rate: float) -> None:
        self.matrices: list[tuple[int, int, int, int]] = []
        self.plain: list[tuple[int, int]] = []
        groups: dict[tuple[int, int, int], _Group] = {}
        q = e = 0
        for offset, shape in tile(shapes, numel):
            if len(shape) >= 2 and shape.numel() > 0:
                n = shape[0]
                m = shape.numel() // n
                r = min(rank, n, m)
                if n * m > (n + m) * r * min_rate:
                    self.matrices.append((offset, n, m, r))
                    group = groups.setdefault((n, m, r), _Group(n, m, r))
                    group.offsets.append(offset)
                    group.q_starts.append(q)
                    group.e_starts.append(e)
                    q, e = q + m * r, e + n * m
                    continue
            self.plain.append((offset, shape.numel()))
        self.groups = list(groups.values())
        p = 0
        for g in self.groups:
            g.p_start = p
            p += len(g.offsets) * g.n * g.r
        self.p_numel, self.q_numel, self.m_numel = p, q, e
        self.plain_numel = sum(k for _, k in self.plain)


class _Scratch:
    """A bucket's working buffers, allocated once and reused every step.

    Fresh multi-megabyte tensors every step cost page faults on first touch (glibc serves them by mmap), which
    profiling showed to be the largest share of PowerSGD's CPU time; torch's hook keeps its P and Q the same way.
    `local` holds this rank's Q (and, for one step, a warm start copied in: one loaded or freshly drawn). The averaged
    Q (state: the next step's warm start) and the residual (state) each alternate between two buffers: a step
    writes into the one the state before it does not hold (`other`), so a skipped step is undone by references.
    """

    def __init__(self, plan: _Plan, bucket: torch.Tensor, dtype: torch.dtype) -> None:
        self.signature = (id(plan), bucket.dtype, bucket.device)
        empty = lambda k, d=dtype: torch.empty(k, dtype=d, device=bucket.device)  # noqa: E731
        self.p = empty(plan.p_numel)
        self.q = [empty(plan.q_numel), empty(plan.q_numel)]
        self.local = empty(plan.q_numel)
        self.errors = [empty(plan.m_numel), empty(plan.m_numel)] if plan.matrices else []
        self.plain = empty(plan.plain_numel, bucket.dtype) if plan.plain else None  # sent as the bucket's dtype
        # An fp32 copy of a 16-bit bucket to work in (QR needs fp32 or fp64).
        self.work = empty(bucket.numel()) if bucket.dtype != dtype else None
        self.ps = [self.p[g.p_start : g.p_start + len(g.offsets) * g.n * g.r].view(len(g.offsets), g.n, g.r)
                   for g in plan.groups]
        self.views = {id(q): [[q[k : k + g.m * g.r].view(g.m, g.r) for k in g.q_starts] for g in plan.groups]
                      for q in (*self.q, self.local)}

    @staticmethod
    def other(pair: list[torch.Tensor], held: torch.Tensor | None) -> torch.Tensor:
        """The buffer of `pair` that `held` (the state before the step) is not."""
        return pair[1] if held is pair[0] else pair[0]


class PowerSGD(Compressor):
    """Rank-`rank` PowerSGD with error feedback (see the module docstring).

    rank: the approximation rank r (the paper: 2 matches full SGD on ResNet/CIFAR; 4 for transformers is common).
    start_iter: reductions of each bucket done uncompressed first (PyTorch's start_powerSGD_iter; ~10% of training
        is its advice). min_compression_rate: compress a matrix only if it shrinks at least this many times
        (PyTorch's default 2). warm_start: reuse last step's Q (True) or draw a fresh one every step.
    seed: the seed of the initial Q, the same on every rank.
    """

    name = "powersgd"

    def __init__(self, rank: int = 4, start_iter: int = 10, min_compression_rate: float = 2.0,
                 warm_start: bool = True, seed: int = 0) -> None:
        super().__init__()
        for what, value, low in (("rank", rank, 1), ("seed", seed, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"PowerSGD: {what}={value!r} must be an int >= {low}")
        if isinstance(min_compression_rate, bool) or not isinstance(min_compression_rate, (int, float)) \
                or not min_compression_rate >= 0:
            raise ValueError(f"PowerSGD: min_compression_rate={min_compression_rate!r} must be a number >= 0 "
                             f"(1: compress whatever shrinks; 0: compress every matrix)")
        if not isinstance(warm_start, bool):
            raise ValueError(f"PowerSGD: warm_start={warm_start!r} must be True or False")
        self.rank = rank
        self.start_iter = check_start_iter("PowerSGD", start_iter)
        self.min_compression_rate = float(min_compression_rate)
        self.warm_start = warm_start
        self.seed = seed
        self._reset_extra_state()

    def _reset_extra_state(self) -> None:
        self.q: dict[str, torch.Tensor] = {}  # per bucket: every compressed matrix's Q, concatenated
        self.plans: dict[tuple, _Plan] = {}
        self.scratch: dict[str, _Scratch] = {}

    def config(self) -> dict:
        return {"method": self.name, "rank": self.rank, "start_iter": self.start_iter,
                "min_compression_rate": self.min_compression_rate, "warm_start": self.warm_start, "seed": self.seed}

    def plan(self, shapes: Shapes | None, numel: int) -> _Plan:
        signature = (numel, None if shapes is None or isinstance(shapes, int) else tuple(tuple(s) for s in shapes))
        plan = self.plans.get(signature)
        if plan is None:
            plan = self.plans[signature] = _Plan(shapes, numel, self.rank, self.min_compression_rate)
        return plan

    # ---- the two-round reduction ------------------------------------------------------------------------------
    def reduce(self, key: Hashable, flat: torch.Tensor, comm: Communicator, shapes: Shapes | None = None) -> Work:
        """Round one now (the P's and the uncompressed tensors, overlapping backward); round two in `wait()`.

        The bucket itself is the working matrix M: the residual is added into it in place, and the result is
        written back over it (no copy of the bucket, unless it is 16-bit: then an fp32 copy, for the QR)."""
        self._check_bucket(flat)
        key = str(key)
        if self._warming_up(key):
            return comm.all_reduce(flat, ReduceOp.AVG, async_op=True)
        iteration = self.iterations[key] - 1
        plan = self.plan(shapes, flat.numel())
        dtype = torch.float32 if flat.element_size() < 4 else flat.dtype  # QR needs fp32 or fp64
        scratch = self.scratch.get(key)
        if scratch is None or scratch.signature != (id(plan), flat.dtype, flat.device):
            scratch = self.scratch[key] = _Scratch(plan, flat, dtype)
        works: list[Work | None] = []
        plain = None
        if plan.plain:
            plain = torch.cat([flat[o : o + k] for o, k in plan.plain], out=scratch.plain)
            works.append(comm.all_reduce(plain, ReduceOp.AVG, async_op=True))
        if not plan.matrices:
            return PendingWork(works, lambda: self._write_plain(flat, plan, plain))
        work = flat if scratch.work is None else scratch.work.copy_(flat)
        ms = [[work[o : o + g.n * g.m].view(g.n, g.m) for o in g.offsets] for g in plan.groups]
        memory = self.memory.get(key)
        scale = self.loss_scale  # the bucket's units; the residual is kept in gradient units
        if memory is not None:
            if memory.numel() != plan.m_numel:
                raise ValueError(f"PowerSGD: bucket {key!r} compresses {plan.m_numel} elements but its "
                                 f"error-feedback memory has {memory.numel()}: the buckets changed after a resume")
            memory = memory.to(dtype)  # a no-op unless loaded from another dtype
            for g, group in zip(plan.groups, ms):
                for i, m in enumerate(group):
                    m.add_(_residual(memory, g, i), alpha=scale)
        warm = scratch.views[id(self._warm_q(key, plan, scratch, iteration))]
        for p, q, group in zip(scratch.ps, warm, ms):
            for i, m in enumerate(group):
                torch.mm(m, q[i], out=p[i])
        works.append(comm.all_reduce(scratch.p, ReduceOp.SUM, async_op=True))

        def finish() -> None:
            for w in works:
                w.wait()
            # Both written into the buffer the state before this step does not hold (it is read above already).
            error = scratch.other(scratch.errors, self._held("memory", key))
            wire = scratch.other(scratch.q, self._held("q", key))
            local = scratch.views[id(scratch.local)]
            for p, q, group in zip(scratch.ps, local, ms):
                # An orthonormal basis of each P's column span (reduced QR: robust when the span is rank-deficient),
                # one batched call per shape.
                p.copy_(torch.linalg.qr(p, mode="reduced").Q)
                for i, m in enumerate(group):
                    torch.mm(m.T, p[i], out=q[i])
            # Q's all-reduce runs while this rank computes its error from its own Q (the paper's residual).
            wire.copy_(scratch.local)
            q_work = comm.all_reduce(wire, ReduceOp.AVG, async_op=True)
            for g, p, q, group in zip(plan.groups, scratch.ps, local, ms):
                for i, m in enumerate(group):
                    torch.addmm(m, p[i], q[i].T, beta=1 / scale, alpha=-1 / scale, out=_residual(error, g, i))
            self._stage("memory", key, error)  # already in gradient units
            q_work.wait()
            self._stage("q", key, wire)  # identical on every rank: the next step's warm start
            for p, q, group in zip(scratch.ps, scratch.views[id(wire)], ms):
                for i, m in enumerate(group):
                    torch.mm(p[i], q[i].T, out=m)
            self._write_plain(work, plan, plain)
            if work is not flat:
                flat.copy_(work)

        return PendingWork([], finish)

    def _warm_q(self, key: str, plan: _Plan, scratch: _Scratch, iteration: int) -> torch.Tensor:
        """The buffer holding this step's starting Q, only read: last step's averaged Q (warm start), or one drawn
        from the generator every rank seeds alike (the first time, or every step without warm start) or loaded from
        a checkpoint, copied into the scratch's `local` (which this step's local Q overwrites once P is computed)."""
        q = self.q.get(key) if self.warm_start else None
        if any(q is buffer for buffer in scratch.q):
            return q
        if q is None or q.numel() != plan.q_numel:
            generator = shared_generator(self.seed, key, 0 if self.warm_start else iteration)
            q = torch.randn(plan.q_numel, generator=generator, dtype=torch.float64)
        return scratch.local.copy_(q)

    def _held(self, kind: str, key: str) -> torch.Tensor | None:
        """The tensor the state before this step holds for (kind, bucket), which this step must not overwrite."""
        before = self._before[kind] if self._before is not None else getattr(self, kind)
        return before.get(key)

    @staticmethod
    def _write_plain(flat: torch.Tensor, plan: _Plan, plain: torch.Tensor | None) -> None:
        if plain is None:
            return
        start = 0
        for offset, k in plan.plain:
            flat[offset : offset + k].copy_(plain[start : start + k])
            start += k

    # The generic compress/decompress path is not used: PowerSGD needs two rounds (see reduce).
    def compress(self, key: str, flat: torch.Tensor, shapes: Shapes | None, world: int) -> Payload:
        raise NotImplementedError("PowerSGD reduces in two rounds: call reduce()")

    def decompress(self, payload: Payload, received: Sequence[torch.Tensor], out: torch.Tensor, world: int) -> None:
        raise NotImplementedError("PowerSGD reduces in two rounds: call reduce()")

    def wire_bytes(self, shapes: Shapes, world: int, element_size: int = 4) -> int:
        """Per-rank bytes of one compressing step (steps before start_iter: a plain all-reduce of the bucket)."""
        numel = total_numel(shapes)
        plan = self.plan(None if isinstance(shapes, int) else shapes, numel)
        total = ring_all_reduce(plan.plain_numel, element_size, world)
        if plan.matrices:
            total += ring_all_reduce(plan.p_numel, element_size, world)
            total += ring_all_reduce(plan.q_numel, element_size, world)
        return total

    # ---- checkpoints ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        state = super().state_dict()
        state.update({f"q/{k}": v.detach().clone() for k, v in self.q.items()})
        return state

    def _load_extra(self, kind: str, key: str, value: torch.Tensor) -> bool:
        if kind == "q":
            self.q[key] = value.detach().clone()
            return True
        return False

    def _extra_kind_names(self) -> tuple[str, ...]:
        return ("q",)


def _residual(memory: torch.Tensor, group: _Group, i: int) -> torch.Tensor:
    """The view of the error-feedback memory that holds matrix `i` of `group`."""
    start = group.e_starts[i]
    return memory[start : start + group.n * group.m].view(group.n, group.m)

