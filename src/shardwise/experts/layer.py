"""The expert-parallel forward of a MoE layer: this rank's tokens to their experts' ranks and back (GShard).

`expert_parallel` mixes `ExpertParallelLayer` into each `MoE` layer of the model (the same module object, its
parameter names unchanged). Rank p of the expert-parallel group `ep` (size P) holds experts
``[p L, (p + 1) L)``, L = E / P, as slices of the fused tensors (ShardedParameters answering for (E, ...)).
`dispatch` is the middle of that forward as a function of the sorted rows and a callback computing this rank's
experts; HuggingFace experts modules use it too (hf_experts.py).

Forward, on this rank's tokens (its part of the global batch)::

    route locally -> the N x k assignments sorted by expert (experts of rank j are contiguous)
    all-to-all of counts         send[j, l] = assignments for rank j's l-th expert; recv[i, l] = rank i's for mine
    all-to-all of rows           the sorted rows, send[j].sum() to rank j      (backward: the gradients come back)
    regroup by local expert      rank 0's rows of expert l, then rank 1's, ...: the batch order of one process
    the local experts run        expert_mlp on the L local slices
    ungroup, all-to-all back     each row returns to the rank and position it came from
    weight and combine locally   as in one process

Because the global batch is the ranks' batches in rank order and the sort is stable, each expert sees exactly the
rows one process would give it, in the same order: with no capacity limit (dropless, MegaBlocks) the step equals
one process's. The load-balancing statistics are summed over `dp` (the ranks splitting the batch: counts with a
plain all-reduce, probability sums with the differentiable `sum_over_ranks`), so the auxiliary loss is the global
batch's on every rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ..comm.base import Communicator, ReduceOp
from ..compiled import eager_while_traced
from ..models.moe import MoE, expert_mlp
from ..sharded_tensor import local
from .ops import all_to_all_rows, exchange_counts, sum_over_ranks

__all__ = ["ExpertGroups", "ExpertParallelLayer", "dispatch"]


@dataclasses.dataclass(frozen=True)
class ExpertGroups:
    """The groups of an expert-parallel model. ep: ranks splitting the experts; dp: ranks splitting the batch (ep
    borrows its ranks from it; the load-balancing statistics are summed over it); edp: ranks of dp holding the same
    experts (size dp / ep), over which the experts' gradients are averaged."""

    ep: Communicator
    dp: Communicator
    edp: Communicator


def dispatch(rows: torch.Tensor, counts: list[int], ep: Communicator,
             compute: Callable[[torch.Tensor, list[int]], torch.Tensor]) -> torch.Tensor:
    """The outputs of every expert for `rows` (M, d), sorted by expert with counts[e] rows for expert e of all E,
    computed by the ranks of `ep` holding them (the forward in the module docstring). `compute(x, local_counts)`
    runs this rank's L = E / ep experts on `x`, their rows grouped by local expert (local_counts[l] rows for the
    l-th), and returns one output row per row. Differentiable; collective over `ep` (every rank calls it, once per
    layer, in the same order)."""
    P, L = ep.size, len(counts) // ep.size
    send = torch.tensor(counts, dtype=torch.int64, device=ep.device).view(P, L)
    recv = exchange_counts(send, ep).cpu()
    send_rows, recv_rows = send.sum(dim=1).tolist(), recv.sum(dim=1).tolist()
    arrived = all_to_all_rows(rows, ep, send_rows, recv_rows)  # by source rank, then by expert
    # Regroup: for each local expert l, the rows of rank 0, then rank 1, ... (one process's batch order). Block
    # (i, l) starts at `starts[i, l]` of `arrived`; laid out l-major, its rows go to `offsets` onwards.
    starts = (torch.cumsum(recv.reshape(-1), 0) - recv.reshape(-1)).view(P, L).t().reshape(-1)
    lengths = recv.t().reshape(-1)
    offsets = torch.cumsum(lengths, 0) - lengths
    by_expert = (torch.repeat_interleave(starts - offsets, lengths)
                 + torch.arange(int(lengths.sum()))).to(rows.device)
    out = compute(arrived[by_expert], recv.sum(dim=0).tolist())
    back = out[torch.argsort(by_expert)]  # by source rank again
    return all_to_all_rows(back, ep, recv_rows, send_rows)


class ExpertParallelLayer(MoE):
    """Mixed into a MoE layer by `expert_parallel`: the forward above. `_ep` holds its ExpertGroups."""

    _ep: ExpertGroups

    # Under torch.compile the layer runs eagerly between the graphs (compiled.py): its all-to-alls, its host reads of
    # the counts, and its slices, whose shapes say the whole (E, ...) to dynamo's guards
    forward = eager_while_traced(MoE.forward)

    def _expert_outputs(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        def compute(x: torch.Tensor, local_counts: list[int]) -> torch.Tensor:
            return expert_mlp(x, local_counts, local(self.w_in), local(self.b_in), local(self.w_out),
                              local(self.b_out), self.act)

        return dispatch(rows, counts, self._ep.ep, compute)

    def _global_stats(self, counts: torch.Tensor, prob_sums: torch.Tensor,
                      n_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dp = self._ep.dp
        summed = torch.cat([counts.to(torch.float64), torch.tensor([float(n_tokens)], dtype=torch.float64,
                                                                    device=counts.device)]).to(dp.device)
        if dp.size > 1:
            dp.all_reduce(summed, ReduceOp.SUM)
        summed = summed.to(counts.device)
        return summed[:-1], sum_over_ranks(prob_sums, dp), summed[-1]
