"""A mixture-of-experts feed-forward layer for the shardwise GPT (``GPTConfig(n_experts=E, experts_per_token=k)``).

Each token goes to k of E expert MLPs, chosen by a learned router, so the parameter count grows with E while the
compute per token stays that of k MLPs (Shazeer et al. 2017; GShard, Lepikhin et al. 2020, arXiv 2006.16668; Switch
Transformer, Fedus et al. 2021, arXiv 2101.03961).

Computation, for the N = B x T tokens x (N, d) of a batch::

    probs   = softmax(router(x))                       (N, E), router = Linear(d, E, bias=False), in float32
    top     = the k largest probs per token            (N, k) expert ids and their probabilities
    weights = top / top.sum(-1)                         renormalised over the k chosen experts (Mixtral)
    y_e     = proj_e(gelu(fc_e(x_t)))                   for every (token t, expert e) assignment
    out_t   = sum over its k assignments of weight x y_e

The experts are stored fused, one tensor per weight across experts: ``w_in`` (E, d, d_ff), ``b_in`` (E, d_ff),
``w_out`` (E, d_ff, d), ``b_out`` (E, d) (biases when ``config.bias``), GELU in between as in the dense MLP. The
N x k assignments are sorted by expert (a stable sort, so each expert sees its tokens in batch order), every expert
runs on its contiguous rows, and the results are put back per assignment and weighted. An expert that receives no
token still runs on zero rows, so its slice of the fused gradient is zeros and the fused parameter always gets a
gradient, exactly as when computing the dense formula: AdamW then treats every expert the same on any layout.

Dropless by default (MegaBlocks, Gale et al. 2022, arXiv 2211.15841): every assignment is computed, however
unbalanced the routing. With ``capacity_factor`` set (attribute, or `expert_parallel(..., capacity_factor=)`), each
expert takes at most ``ceil(capacity_factor x N x k / E)`` assignments of this rank's tokens, in batch order; the
others are dropped (their contribution is zero; the token still flows through the residual connection), as in GShard
and Switch. ``stats`` reports the last forward's counts: ``{"assignments", "dropped", "capacity"}``.

Load balancing. Without a penalty the router collapses onto a few experts. The Switch auxiliary loss is::

    aux = E x sum_i f_i x P_i,  f_i = (assignments to expert i) / (N x k),  P_i = mean over tokens of probs[:, i]

f_i is a count (no gradient), P_i is differentiable; aux is 1 for a perfectly uniform router and grows as the
routing concentrates (Megatron-core's normalisation for top-k). It is a product of two *batch* means, so under data
parallel it must be computed over the global batch: `_global_stats` sums the counts and the probability sums over
``batch_group``, the ranks that split the batch, which every data-parallel wrapper (DDP, ZeRO, FSDP) sets at wrap
time through `set_batch_group` (the expert-parallel layer, shardwise.experts, sums over its dp group). Under sequence
parallel each tensor-parallel rank routes its own shard of every sequence, so the statistics are first summed over
``sequence_group`` (`set_sequence_group`, called by tensor parallel), forward only: every rank of that group then
computes the same loss, which tensor parallel counts once (Megatron's g operator). The GPT adds
``moe_aux_loss_coef x sum(aux)`` over its MoE layers to the returned loss. ``aux_loss`` holds the last forward's
value (None when the coefficient is 0).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import torch
import torch.nn as nn

__all__ = ["MoE", "MoEConfig", "Routing", "route", "expert_mlp", "capacity"]


class MoEConfig(Protocol):
    """The fields of a model configuration that `MoE` reads (gpt.GPTConfig has them; gpt.py imports this module,
    so the layer names the fields rather than the class)."""

    n_experts: int
    experts_per_token: int
    d_model: int
    ff_dim: int
    bias: bool
    dropout: float
    moe_aux_loss_coef: float


@dataclasses.dataclass(frozen=True)
class Routing:
    """The router's decision for N tokens. probs (N, E) float32; experts (N, k) ids; weights (N, k) renormalised;
    order (N k,) the assignments (token t's j-th choice is t x k + j) sorted by expert, stable; counts (E,) int64."""

    probs: torch.Tensor
    experts: torch.Tensor
    weights: torch.Tensor
    order: torch.Tensor
    counts: torch.Tensor


def route(logits: torch.Tensor, k: int) -> Routing:
    """Softmax over the router logits (float32), the top k, renormalised (see the module docstring)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, experts = probs.topk(k, dim=-1)
    weights = top / top.sum(dim=-1, keepdim=True)
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=logits.shape[-1])
    return Routing(probs, experts, weights, order, counts)


def capacity(n_tokens: int, k: int, n_experts: int, capacity_factor: float) -> int:
    """Assignments one expert takes from one rank's `n_tokens` tokens: ceil(factor x n_tokens x k / E) (GShard)."""
    return math.ceil(capacity_factor * n_tokens * k / n_experts)


def expert_mlp(x: torch.Tensor, counts: list[int], w_in: torch.Tensor, b_in: torch.Tensor | None,
               w_out: torch.Tensor, b_out: torch.Tensor | None, act: nn.Module) -> torch.Tensor:
    """proj_e(act(fc_e(rows))) for rows `x` (M, d) grouped by expert: counts[e] rows for expert e, in order.

    The weights are the fused (E', ...) tensors of the E' = len(counts) experts held here. A loop over experts
    (MegaBlocks' grouped GEMM would do it in one kernel); an expert with no row still runs, on zero rows, so its
    weights get a zero gradient rather than none (module docstring)."""
    outs = []
    biases_in = b_in.unbind(0) if b_in is not None else [None] * len(counts)
    biases_out = b_out.unbind(0) if b_out is not None else [None] * len(counts)
    for rows, wi, bi, wo, bo in zip(x.split(counts), w_in.unbind(0), biases_in, w_out.unbind(0), biases_out):
        h = rows @ wi
        h = act(h + bi if bi is not None else h) @ wo
        outs.append(h + bo if bo is not None else h)
    return torch.cat(outs) if outs else x.new_zeros(0, w_out.shape[-1])


class MoE(nn.Module):
    """The GPT block's feed-forward as a mixture of experts (see the module docstring).

    Parameters: ``router.weight`` (E, d), ``w_in`` (E, d, d_ff), ``b_in`` (E, d_ff), ``w_out`` (E, d_ff, d),
    ``b_out`` (E, d) (no biases when ``config.bias`` is False). Attributes: ``capacity_factor`` (None: dropless),
    ``aux_loss`` (the last forward's Switch loss, unscaled), ``stats`` (the last forward's assignment counts).
    """

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        E, d, ff = config.n_experts, config.d_model, config.ff_dim
        self.n_experts, self.top_k, self.d_model = E, config.experts_per_token, d
        self.aux_loss_coef = config.moe_aux_loss_coef
        self.capacity_factor: float | None = None
        self.router = nn.Linear(d, E, bias=False)
        self.w_in = nn.Parameter(torch.empty(E, d, ff))
        self.b_in = nn.Parameter(torch.empty(E, ff)) if config.bias else None
        self.w_out = nn.Parameter(torch.empty(E, ff, d))
        self.b_out = nn.Parameter(torch.empty(E, d)) if config.bias else None
        self.act = nn.GELU()
        self.drop = nn.Dropout(config.dropout)
        self.aux_loss: torch.Tensor | None = None
        self.stats: dict[str, int | None] = {}
        self.batch_group = None  # the Communicator of the ranks splitting the batch (set_batch_group); None: alone
        self.sequence_group = None  # the ranks splitting each sequence (set_sequence_group); None: whole sequences
        if self.w_in.device.type != "meta":
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None, std: float = 0.02,
                         resid_std: float | None = None) -> None:
        """N(0, std) for the router, then `reset_experts` (draws on the CPU in float32, from `generator`)."""
        _normal_(self.router.weight, std, generator)
        self.reset_experts(generator, std, resid_std)

    @torch.no_grad()
    def reset_experts(self, generator: torch.Generator | None = None, std: float = 0.02,
                      resid_std: float | None = None) -> None:
        """N(0, std) for ``w_in``, N(0, resid_std) for ``w_out`` (the residual projection), zero biases. The GPT
        calls it with its own generator in module order (its router is drawn as the nn.Linear it is)."""
        _normal_(self.w_in, std, generator)
        _normal_(self.w_out, std if resid_std is None else resid_std, generator)
        for bias in (self.b_in, self.b_out):
            if bias is not None:
                bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        n, k, E = flat.shape[0], self.top_k, self.n_experts
        r = route(self.router(flat), k)
        tokens = r.order // k  # the token of each sorted assignment
        sent, cap, kept = r.counts, None, r.order
        if self.capacity_factor is not None:
            cap = capacity(n, k, E, self.capacity_factor)
            experts_sorted = r.experts.reshape(-1)[r.order]
            position = torch.arange(n * k, device=flat.device) - (torch.cumsum(r.counts, 0) - r.counts)[experts_sorted]
            keep = position < cap
            sent, tokens, kept = r.counts.clamp(max=cap), tokens[keep], r.order[keep]
        y = self._expert_outputs(flat[tokens], sent.tolist())
        per_assignment = flat.new_zeros(n * k, flat.shape[1]).index_copy(0, kept, y)
        out = (per_assignment.view(n, k, -1) * r.weights.to(flat.dtype).unsqueeze(-1)).sum(dim=1)
        self.stats = {"assignments": n * k, "dropped": n * k - int(kept.numel()), "capacity": cap}
        self.aux_loss = self._balance_loss(r, n) if self.aux_loss_coef > 0 else None
        return self.drop(out.view(shape))

    def _expert_outputs(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every expert's output for its rows (grouped by expert, counts[e] each). Expert parallel overrides it."""
        return expert_mlp(rows, counts, self.w_in, self.b_in, self.w_out, self.b_out, self.act)

    def set_batch_group(self, comm: object) -> None:
        """The ranks that split the batch (a data-parallel wrapper's group): the balance statistics are summed over
        them, so the auxiliary loss is the global batch's. The first wrapper to set it wins (an outer one over the
        same batch split adds nothing)."""
        if self.batch_group is None:
            self.batch_group = comm

    def set_sequence_group(self, comm: object) -> None:
        """The ranks that split each sequence of this rank's batch (tensor parallel's group under sequence parallel):
        the balance statistics are summed over them before `batch_group` (module docstring)."""
        self.sequence_group = comm

    def _global_stats(self, counts: torch.Tensor, prob_sums: torch.Tensor,
                      n_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(assignment counts, probability sums, tokens) over the whole batch: summed over `batch_group` (counts by
        a plain all-reduce, probability sums by one whose backward sums too: experts/ops.py says why)."""
        summed = torch.cat([counts.to(torch.float64), torch.tensor([float(n_tokens)], dtype=torch.float64,
                                                                    device=counts.device)])
        group = self.batch_group
        if group is None or group.size == 1:
            return summed[:-1], prob_sums, summed[-1]
        from ..comm.base import ReduceOp
        from ..experts.ops import sum_over_ranks  # experts imports this module: import at call time

        summed = summed.to(group.device)
        group.all_reduce(summed, ReduceOp.SUM)
        summed = summed.to(counts.device)
        return summed[:-1], sum_over_ranks(prob_sums, group), summed[-1]

    def _balance_loss(self, r: Routing, n_tokens: int) -> torch.Tensor:
        counts, prob_sums = r.counts, r.probs.sum(dim=0)
        if self.sequence_group is not None and self.sequence_group.size > 1:
            counts, prob_sums, n_tokens = _sum_over_sequence(counts, prob_sums, n_tokens, self.sequence_group)
        counts, prob_sums, total = self._global_stats(counts, prob_sums, n_tokens)
        f = (counts / (total * self.top_k)).to(prob_sums.dtype)
        p = prob_sums / total.to(prob_sums.dtype)
        return self.n_experts * (f * p).sum()

    def extra_repr(self) -> str:
        return (f"n_experts={self.n_experts}, experts_per_token={self.top_k}, d_model={self.d_model}, "
                f"d_ff={self.w_in.shape[-1]}, capacity_factor={self.capacity_factor}")


def _sum_over_sequence(counts: torch.Tensor, prob_sums: torch.Tensor, n_tokens: int,
                       group: object) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The statistics of the whole sequences: summed over the ranks holding their shards. The probability sums' backward
    is the identity: each rank of `group` backpropagates the same loss, whose gradient tensor parallel counts once."""
    from ..comm.base import ReduceOp
    from ..tensor_parallel.mappings import reduce_from_region  # tensor_parallel imports models: at call time

    summed = torch.cat([counts.to(torch.float64), torch.tensor([float(n_tokens)], dtype=torch.float64,
                                                                device=counts.device)]).to(group.device)
    group.all_reduce(summed, ReduceOp.SUM)
    summed = summed.to(counts.device)
    return summed[:-1], reduce_from_region(prob_sums, group), int(summed[-1])


def _normal_(weight: torch.Tensor, std: float, generator: torch.Generator | None) -> None:
    # Drawn on the CPU in fp32 whatever the weight's device and dtype, as the GPT's own initialiser does.
    weight.copy_(torch.empty(weight.shape, dtype=torch.float32, device="cpu").normal_(0.0, std, generator=generator))
