"""The differentiable collectives of expert parallelism, each a tiny autograd Function named after what it does.

* `all_to_all_rows(x, comm, send, recv)`: rows of `x` go to the ranks of `comm` (send[j] rows to rank j, in order)
  and rows come back from them (recv[i] from rank i, concatenated in rank order). The backward pass is the reverse
  all-to-all of the gradient: the gradient of a row goes back to the rank that sent it (GShard's dispatch and
  combine, Lepikhin et al. 2020, arXiv 2006.16668).
* `sum_over_ranks(x, comm)`: all-reduce (sum) in the forward pass and in the backward pass. It is the adjoint that
  makes a statistic of the *global* batch right under data parallel: every rank's loss uses the same global sum S
  of the ranks' partial sums s_r, and the data-parallel gradient is the mean over ranks of each rank's gradient, so
  rank r's s_r must receive the sum over ranks of dL_r'/dS (n x dL/dS): the mean then gives one process's gradient.
* `exchange_counts(counts, comm)`: the all-to-all of token counts that precedes a dispatch, so that every rank
  allocates exactly what it receives (uneven splits).
All of them return early, with no communication, for a group of one.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm.base import Communicator, ReduceOp
from ..graph_gradients import refuse_second_order

__all__ = ["all_to_all_rows", "sum_over_ranks", "exchange_counts"]


def _exchange(x: torch.Tensor, comm: Communicator, send: list[int], recv: list[int]) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    comm.all_to_all(list(out.split(recv)), list(x.split(send)))
    return out


class _AllToAllRows(torch.autograd.Function):
    """Forward: rows to their ranks (all-to-all). Backward: the gradient rows back to where they came from."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, send: list[int], recv: list[int]) -> torch.Tensor:
        ctx.comm, ctx.send, ctx.recv = comm, send, recv
        return _exchange(x, comm, send, recv)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        refuse_second_order("expert parallel's all-to-all")
        return _exchange(grad, ctx.comm, ctx.recv, ctx.send), None, None, None


def all_to_all_rows(x: torch.Tensor, comm: Communicator, send: list[int], recv: list[int]) -> torch.Tensor:
    """x (sum(send), ...) -> (sum(recv), ...): send[j] rows to rank j, recv[i] rows from rank i (module docstring)."""
    if comm.size == 1:
        return x
    return _AllToAllRows.apply(x, comm, send, recv)


class _SumOverRanks(torch.autograd.Function):
    """Forward: all-reduce (sum). Backward: all-reduce (sum) of the gradient (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        out = x.detach().clone()
        comm.all_reduce(out, ReduceOp.SUM)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        refuse_second_order("expert parallel's sum over ranks")
        out = grad.contiguous().clone()
        ctx.comm.all_reduce(out, ReduceOp.SUM)
        return out, None


def sum_over_ranks(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """The sum of `x` over the ranks of `comm`, differentiable (module docstring); `x` itself for a group of one."""
    if comm.size == 1:
        return x
    return _SumOverRanks.apply(x, comm)


def exchange_counts(counts: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """counts (size x L) int64, row j what this rank sends rank j -> (size x L), row i what rank i sends here."""
    if comm.size == 1:
        return counts
    counts = counts.contiguous()
    out = torch.empty_like(counts)
    comm.all_to_all(list(out.unbind(0)), list(counts.unbind(0)))
    return out
