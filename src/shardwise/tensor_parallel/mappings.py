"""Differentiable communication: the autograd operators that move activations between tensor-parallel regions.

Megatron-LM (Shoeybi et al., 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism", section 3) builds tensor parallelism from two conjugate operators around each MLP or attention block:

* ``f`` = :func:`copy_to_region`: identity in forward, all-reduce of the gradient in backward. It sits where a
  replicated activation enters a column-parallel layer: every rank reads the whole input, so the input's gradient
  is the sum of every rank's partial gradient.
* ``g`` = :func:`reduce_from_region`: all-reduce in forward, identity in backward. It sits after a row-parallel
  layer, whose ranks each hold a partial sum of the output.

Sequence parallelism (Korthikanti et al., 2022, "Reducing Activation Recomputation in Large Transformer Models",
section 4.2.2) splits the replicated regions between blocks (LayerNorm, dropout, residual adds) along the sequence
dimension. An all-reduce is a reduce-scatter followed by an all-gather, so ``g`` becomes ``g-bar`` =
:func:`reduce_scatter_to_sequence_region` (reduce-scatter forward, all-gather backward) and ``f`` becomes ``f-bar``
= :func:`gather_from_sequence_region` (all-gather forward, reduce-scatter backward): the same bytes on the wire,
while the activations between them are 1/tp of the size.

Each operator is a tiny ``torch.autograd.Function`` named after what it does in forward, takes its Communicator
explicitly (no global process group), and returns its input unchanged, without touching the Communicator, when the
group has one rank. Every tensor a collective writes into is a fresh buffer (activations and incoming gradients are
never reduced in place: autograd may hold them elsewhere).

Layout helpers: ``dim`` is any tensor dimension (negative allowed); the size along it must be divisible by the
group size for the splitting operators. ``all_gather`` of the Communicator is flat (rank r's chunk lands at
``r * numel``), so gathering along a dimension other than 0 gathers into a ``(size, *shape)`` buffer and moves the
rank axis next to ``dim``: one extra copy, cheap next to the matmuls around it.
"""

from __future__ import annotations

import torch

from ..comm.base import Communicator, ReduceOp
from ..graph_gradients import refuse_second_order

__all__ = [
    "copy_to_region",
    "reduce_from_region",
    "gather_from_region",
    "scatter_to_region",
    "gather_from_sequence_region",
    "reduce_scatter_to_sequence_region",
    "scatter_to_sequence_region",
    "split_along",
    "all_gather_along",
    "reduce_scatter_along",
]


# ---- plain (non-differentiable) building blocks ---------------------------------------------------------------------
def _norm_dim(x: torch.Tensor, dim: int) -> int:
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def _check_divisible(what: str, x: torch.Tensor, dim: int, size: int) -> None:
    if x.shape[dim] % size:
        raise ValueError(
            f"{what}: size {x.shape[dim]} of dim {dim} (shape {tuple(x.shape)}) is not divisible by the "
            f"tensor-parallel size {size}"
        )


def split_along(x: torch.Tensor, dim: int, comm: Communicator) -> torch.Tensor:
    """This rank's contiguous chunk of `x` along `dim` (chunk `comm.rank` of `comm.size` equal chunks)."""
    dim = _norm_dim(x, dim)
    _check_divisible("split", x, dim, comm.size)
    chunk = x.shape[dim] // comm.size
    return x.narrow(dim, comm.rank * chunk, chunk).contiguous()


def all_gather_along(x: torch.Tensor, dim: int, comm: Communicator) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order (the inverse of `split_along`)."""
    dim = _norm_dim(x, dim)
    if comm.size == 1:
        return x.clone()
    x = x.contiguous()
    out = torch.empty((comm.size, *x.shape), dtype=x.dtype, device=x.device)
    comm.all_gather(out, x)
    shape = list(x.shape)
    shape[dim] *= comm.size
    if dim == 0:
        return out.view(shape)
    return out.movedim(0, dim).reshape(shape)


def reduce_scatter_along(x: torch.Tensor, dim: int, comm: Communicator) -> torch.Tensor:
    """Sum `x` over the ranks and keep this rank's chunk along `dim` (the reduce-scatter of an activation)."""
    dim = _norm_dim(x, dim)
    _check_divisible("reduce_scatter", x, dim, comm.size)
    n = comm.size
    if n == 1:
        return x.clone()
    # Bring the chunk index to the front so the flat reduce-scatter hands chunk r to rank r.
    chunked = x.unflatten(dim, (n, x.shape[dim] // n)).movedim(dim, 0).contiguous()
    out = torch.empty(chunked.shape[1:], dtype=x.dtype, device=x.device)
    comm.reduce_scatter(out, chunked, ReduceOp.SUM)
    return out


def _all_reduced(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    out = x.contiguous().clone()
    comm.all_reduce(out, ReduceOp.SUM)
    return out


# ---- the autograd operators -----------------------------------------------------------------------------------------
class _CopyToRegion(torch.autograd.Function):
    """Megatron's ``f``: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator) -> torch.Tensor:  # noqa: ANN001
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        refuse_second_order("tensor parallel")
        return _all_reduced(grad, ctx.comm), None


class _ReduceFromRegion(torch.autograd.Function):
    """Megatron's ``g``: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator) -> torch.Tensor:  # noqa: ANN001
        return _all_reduced(x, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    """All-gather along `dim` forward; keep this rank's chunk of the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:  # noqa: ANN001
        ctx.comm, ctx.dim = comm, dim
        return all_gather_along(x, dim, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return split_along(grad, ctx.dim, ctx.comm), None, None


class _ScatterToRegion(torch.autograd.Function):
    """Keep this rank's chunk along `dim` forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:  # noqa: ANN001
        ctx.comm, ctx.dim = comm, dim
        return split_along(x, dim, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        refuse_second_order("tensor parallel")
        return all_gather_along(grad, ctx.dim, ctx.comm), None, None


class _GatherFromSequenceRegion(torch.autograd.Function):
    """Korthikanti's ``f-bar``: all-gather along the sequence dim forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:  # noqa: ANN001
        ctx.comm, ctx.dim = comm, dim
        return all_gather_along(x, dim, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        refuse_second_order("tensor parallel")
        return reduce_scatter_along(grad, ctx.dim, ctx.comm), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    """Korthikanti's ``g-bar``: reduce-scatter along the sequence dim forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:  # noqa: ANN001
        ctx.comm, ctx.dim = comm, dim
        return reduce_scatter_along(x, dim, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        refuse_second_order("tensor parallel")
        return all_gather_along(grad, ctx.dim, ctx.comm), None, None


# ---- public functions ------------------------------------------------------------------------------------------------
def copy_to_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Megatron ``f``: enter a tensor-parallel region. Identity forward; the gradient is all-reduced (summed)."""
    return x if comm.size == 1 else _CopyToRegion.apply(x, comm)


def reduce_from_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Megatron ``g``: leave a tensor-parallel region. Partial sums are all-reduced forward; identity backward."""
    return x if comm.size == 1 else _ReduceFromRegion.apply(x, comm)


def gather_from_region(x: torch.Tensor, comm: Communicator, dim: int = -1) -> torch.Tensor:
    """All-gather the ranks' chunks along `dim` (default: the last, the hidden dim) forward; split backward."""
    if comm.size == 1:
        return x
    return _GatherFromRegion.apply(x, comm, _norm_dim(x, dim))


def scatter_to_region(x: torch.Tensor, comm: Communicator, dim: int = -1) -> torch.Tensor:
    """Keep this rank's chunk along `dim` (default: the last) forward; all-gather the gradient backward."""
    if comm.size == 1:
        return x
    dim = _norm_dim(x, dim)
    _check_divisible("scatter_to_region", x, dim, comm.size)
    return _ScatterToRegion.apply(x, comm, dim)


def gather_from_sequence_region(x: torch.Tensor, comm: Communicator, dim: int = 1) -> torch.Tensor:
    """Sequence-parallel ``f-bar``: all-gather sequence shards along `dim` (default 1, batch-first) forward;
    reduce-scatter the gradient backward (every rank's full-sequence gradient is partial)."""
    if comm.size == 1:
        return x
    return _GatherFromSequenceRegion.apply(x, comm, _norm_dim(x, dim))


def reduce_scatter_to_sequence_region(x: torch.Tensor, comm: Communicator, dim: int = 1) -> torch.Tensor:
    """Sequence-parallel ``g-bar``: reduce-scatter partial sums along `dim` (default 1) forward, so each rank
    keeps the summed values of its sequence shard; all-gather the gradient backward."""
    if comm.size == 1:
        return x
    dim = _norm_dim(x, dim)
    _check_divisible("reduce_scatter_to_sequence_region", x, dim, comm.size)
    return _ReduceScatterToSequenceRegion.apply(x, comm, dim)


def scatter_to_sequence_region(x: torch.Tensor, comm: Communicator, dim: int = 1) -> torch.Tensor:
    """Enter the sequence-parallel region from a replicated activation: keep this rank's sequence shard forward;
    all-gather the gradient backward (each rank's shard gradient is complete, so no reduction is needed)."""
    return scatter_to_region(x, comm, dim)
