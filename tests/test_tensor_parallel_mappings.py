"""The differentiable collectives of tensor_parallel.mappings: forward and backward against values computed from
every rank's data, the collective each one issues, the early return for one rank, and shape errors."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise.tensor_parallel import mappings as M

SHAPE = (4, 8, 12)  # (B, T, d): every dim divisible by 2 and 4


def data(tag: int, rank: int, shape=SHAPE) -> torch.Tensor:
    """A deterministic tensor per (tag, rank): every rank can rebuild every other rank's data."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * tag + rank), dtype=torch.float64)


def chunk(t: torch.Tensor, dim: int, rank: int, n: int) -> torch.Tensor:
    return t.chunk(n, dim)[rank]


def run_op(comm, name, dim):
    """Apply operator `name` on this rank; return (output, input grad, expected output, expected grad, stats)."""
    n, r = comm.size, comm.rank
    full = data(1, 0)  # the same on every rank
    per_rank = [data(2, q) for q in range(n)]  # different on every rank
    grads_full = [data(3, q) for q in range(n)]  # upstream gradients, different per rank
    with comm.stats.measure() as stats:
        if name == "copy_to_region":
            x = full.clone().requires_grad_()
            out = M.copy_to_region(x, comm)
            want, g = full, grads_full[r]
            want_grad = sum(grads_full)
        elif name == "reduce_from_region":
            x = per_rank[r].clone().requires_grad_()
            out = M.reduce_from_region(x, comm)
            want, g = sum(per_rank), grads_full[0]
            want_grad = grads_full[0]
        elif name == "gather_from_region":
            x = chunk(full, dim, r, n).clone().requires_grad_()
            out = M.gather_from_region(x, comm, dim)
            want, g = full, grads_full[0]
            want_grad = chunk(grads_full[0], dim, r, n)
        elif name == "scatter_to_region":
            x = full.clone().requires_grad_()
            out = M.scatter_to_region(x, comm, dim)
            want, g = chunk(full, dim, r, n), chunk(grads_full[r], dim, r, n)
            want_grad = torch.cat([chunk(grads_full[q], dim, q, n) for q in range(n)], dim)
        elif name == "gather_from_sequence_region":
            x = chunk(full, dim, r, n).clone().requires_grad_()
            out = M.gather_from_sequence_region(x, comm, dim)
            want, g = full, grads_full[r]
            want_grad = chunk(sum(grads_full), dim, r, n)
        elif name == "reduce_scatter_to_sequence_region":
            x = per_rank[r].clone().requires_grad_()
            out = M.reduce_scatter_to_sequence_region(x, comm, dim)
            want, g = chunk(sum(per_rank), dim, r, n), chunk(grads_full[r], dim, r, n)
            want_grad = torch.cat([chunk(grads_full[q], dim, q, n) for q in range(n)], dim)
        else:  # scatter_to_sequence_region
            x = full.clone().requires_grad_()
            out = M.scatter_to_sequence_region(x, comm, dim)
            want, g = chunk(full, dim, r, n), chunk(grads_full[r], dim, r, n)
            want_grad = torch.cat([chunk(grads_full[q], dim, q, n) for q in range(n)], dim)
        out.backward(g)
    return out.detach(), x.grad, want, want_grad, stats.as_dict()


# operator -> (forward collective, backward collective, payload of each relative to the full tensor)
COLLECTIVES = {
    "copy_to_region": (None, "all_reduce"),
    "reduce_from_region": ("all_reduce", None),
    "gather_from_region": ("all_gather", None),
    "scatter_to_region": (None, "all_gather"),
    "gather_from_sequence_region": ("all_gather", "reduce_scatter"),
    "reduce_scatter_to_sequence_region": ("reduce_scatter", "all_gather"),
    "scatter_to_sequence_region": (None, "all_gather"),
}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", sorted(COLLECTIVES))
def test_forward_and_backward_match_the_math(name, world):
    dims = [1] if "sequence" in name else [-1, 0, 1]
    if name in ("copy_to_region", "reduce_from_region"):
        dims = [None]
    for dim in dims:
        results = sw.launch(run_op, world, name, dim)
        full_bytes = torch.Size(SHAPE).numel() * 8
        for out, grad, want, want_grad, stats in results:
            torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
            torch.testing.assert_close(grad, want_grad, rtol=0, atol=1e-12)
            ops = [op for op in COLLECTIVES[name] if op]
            assert sorted(stats) == sorted(ops), stats
            for op in ops:  # one call moving the full activation (gathered output / unreduced input)
                assert stats[op] == {"calls": 1, "bytes": full_bytes,
                                     "wire_bytes": sw.comm.base.wire_bytes(op, full_bytes, world)}


@pytest.mark.parametrize("name", sorted(COLLECTIVES))
def test_one_rank_returns_the_input_without_communicating(name):
    comm = sw.init()
    x = data(1, 0).requires_grad_()
    op = getattr(M, name)
    out = op(x, comm) if name in ("copy_to_region", "reduce_from_region") else op(x, comm, 1)
    assert out is x
    assert comm.stats.calls() == 0


def test_undivisible_dims_are_value_errors_naming_the_sizes():
    def body(comm):
        x = torch.zeros(2, 7, 4)
        with pytest.raises(ValueError, match=r"size 7 of dim 1 .* not divisible by the tensor-parallel size 2"):
            M.reduce_scatter_to_sequence_region(x, comm, 1)
        with pytest.raises(ValueError, match=r"size 7 of dim 1"):
            M.scatter_to_region(x, comm, 1)
        with pytest.raises(ValueError, match=r"dim=3 is out of range"):
            M.gather_from_region(x, comm, 3)

    sw.launch(body, 2)
