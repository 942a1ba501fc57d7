"""The expert-parallel forward of a HuggingFace MoE block's experts: the block's own router, shardwise's dispatch.

A HuggingFace sparse MoE block (Mixtral's ``MixtralSparseMoeBlock``, Switch's ``SwitchTransformersSparseMLP``) runs
its router and hands its ``experts`` module the tokens with their routing: Mixtral's ``(hidden (N, d), top_k_index
(N, k), top_k_weights (N, k))``, Switch's ``(hidden (N, d), dispatch mask (N, k, E), routing weights (N, k))``.
`expert_parallel` mixes one of the classes below into that ``experts`` module only, so the router (its softmax,
top-k, renormalisation, Switch's per-sequence capacity, the router logits the model records for its losses) stays
HuggingFace's code, run locally on this rank's tokens as one process runs it on the global batch. The experts
module then:

    assignments   (token, expert, weight) for every routed pair, sorted by expert (stable: one process's order)
    dispatch      layer.dispatch: counts and rows to the experts' ranks by all-to-all, this rank's experts run
                  (`_compute`), the rows come back (GShard, Lepikhin et al. 2020, arXiv 2006.16668)
    combine       out[token] += weight x expert output, in expert order, as HuggingFace's eager loop adds them

Fused experts (``MixtralExperts``: ``gate_up_proj`` (E, 2 f, d), ``down_proj`` (E, d, f); GPT-OSS's transposed
weights with biases, (E, d, 2 f), (E, 2 f), (E, f, d), (E, d), and its own gate: hf_kinds.py): this rank holds the
slices of its E / ep experts and runs each of them, on zero rows too, so its slices always get a gradient, as the
fused tensors do in one process (any token gives the whole tensor a gradient, zeros in the unused experts' rows).

Experts as modules (``SwitchTransformersExperts``: a ModuleDict of ``expert_<i>`` MLPs): in one process an expert
no token reaches is not run, and its weights keep ``grad = None`` (AdamW then skips them: no weight decay, no
moment update). Under expert parallel the routing counts are summed over the data-parallel group (one small
all-reduce per layer), and an expert runs, on its rank, on whatever rows reached it (possibly none) exactly when
some rank of the whole batch routed a token to it; the other ranks' empty pieces of its weights are attached to the
output (`_Attach`) so that they get an empty gradient in the same steps. So ``grad is None`` is the same on every
rank and equals one process's; an edp replica whose ranks had no token for a used expert contributes zeros to the
expert-data-parallel average, which is then one process's gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..compiled import eager_while_traced
from ..comm.base import ReduceOp
from ..sharded_tensor import local
from .layer import ExpertGroups, dispatch

__all__ = ["FusedExpertsParallel", "Llama4MoeParallel", "ModuleExpertsParallel"]


class _Attach(torch.autograd.Function):
    """Forward: `x` (a copy). Backward: `x`'s gradient, and a zero gradient shaped like each of `pieces` (this rank's
    empty pieces of an expert held elsewhere), so that they get a gradient exactly when the expert runs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, *pieces: torch.Tensor) -> torch.Tensor:
        ctx.pieces = [(p.shape, p.dtype, p.device) for p in pieces]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (grad, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.pieces))


class _ExpertsParallel(nn.Module):
    """What both kinds share: the groups (`_sw_ep`, ExpertGroups) and the assignments -> output path."""

    _sw_ep: ExpertGroups

    def _combine(self, hidden: torch.Tensor, tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                 compute: Any, scale_inputs: bool = False) -> torch.Tensor:
        """out (N, d): for each assignment (tokens[a], experts[a], weights[a]) in the order given (already grouped by
        expert), weight x the expert's output for the token (or, `scale_inputs`, the expert's output for weight x the
        token: Llama 4's), added into the token's row."""
        counts = torch.bincount(experts, minlength=self.num_experts).tolist()
        rows = hidden[tokens]
        if scale_inputs:
            rows = rows * weights.unsqueeze(-1)
        y = dispatch(rows, counts, self._sw_ep.ep, compute)
        if not scale_inputs:
            y = y * weights.unsqueeze(-1)
        return torch.zeros_like(hidden).index_add_(0, tokens, y.to(hidden.dtype))

    def _local_range(self) -> range:
        ep = self._sw_ep.ep
        per_rank = self.num_experts // ep.size
        return range(ep.rank * per_rank, (ep.rank + 1) * per_rank)


class FusedExpertsParallel(_ExpertsParallel):
    """Mixed into a ``MixtralExperts``-style module whose ``gate_up_proj`` / ``down_proj`` (and GPT-OSS's biases) hold
    this rank's slices (ShardedParameters answering for (E, ...)). Computes HuggingFace's eager formula of the
    module's template: Mixtral's ``gate, up = (x @ gate_up[e].T).chunk(2)``, ``act(gate) * up @ down[e].T``;
    GPT-OSS's ``_apply_gate(x @ gate_up[e] + b_gu[e]) @ down[e] + b_d[e]``; weighted by the router."""

    @eager_while_traced  # a host sync and an all-to-all; its slices' shapes say the whole (E, ...): not traceable
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        n, k = top_k_index.shape
        # Slot-major (the j-th choices of all tokens, then the next), then a stable sort by expert: within an expert
        # the order of HuggingFace's `torch.where(expert_mask[e])`. Index E means "no expert" there: skipped.
        experts = top_k_index.t().reshape(-1)
        tokens = torch.arange(n, device=hidden_states.device).repeat(k)
        weights = top_k_weights.t().reshape(-1)
        keep = experts < self.num_experts
        experts, tokens, weights = experts[keep], tokens[keep], weights[keep]
        order = torch.argsort(experts, stable=True)
        return self._combine(hidden_states, tokens[order], experts[order], weights[order], self._compute)

    _sw_template: str  # "mixtral", "gpt_oss" or "llama4" (experts/hf_kinds.py)

    @eager_while_traced  # as forward
    def scaled_input_forward(self, hidden_states: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Llama 4's routed output (N, d) of tokens `hidden_states` (N, d) and the router's scores (N, E): one process
        runs every expert on every token, its input scaled by the token's score for it (0 for an expert not chosen,
        whose output is then 0, and so is its gradient); here each (token, expert) pair with a score above 0 is sent
        to the expert's rank (in expert order, then token order), its input ``x * score`` as one process forms it,
        and the outputs are added up per token in expert order, as one process's sum over experts."""
        experts, tokens = torch.nonzero(scores.t() > 0, as_tuple=True)
        return self._combine(hidden_states, tokens, experts, scores[tokens, experts], self._compute, scale_inputs=True)

    def _compute(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        outs = []
        gate_up, down = local(self.gate_up_proj).unbind(0), local(self.down_proj).unbind(0)
        if self._sw_template == "gpt_oss":  # transposed weights with biases, the class's own gate: its eager loop
            gate_up_bias, down_bias = local(self.gate_up_proj_bias).unbind(0), local(self.down_proj_bias).unbind(0)
            for rows, w_gu, b_gu, w_d, b_d in zip(x.split(counts), gate_up, gate_up_bias, down, down_bias):
                outs.append(self._apply_gate(rows @ w_gu + b_gu) @ w_d + b_d)
            return torch.cat(outs)
        if self._sw_template == "llama4":  # transposed weights, no biases: its bmm's per expert
            for rows, w_gu, w_d in zip(x.split(counts), gate_up, down):
                gate, up = (rows @ w_gu).chunk(2, dim=-1)
                outs.append((up * self.act_fn(gate)) @ w_d)
            return torch.cat(outs)
        for rows, w_gu, w_d in zip(x.split(counts), gate_up, down):
            gate, up = F.linear(rows, w_gu).chunk(2, dim=-1)
            outs.append(F.linear(self.act_fn(gate) * up, w_d))
        return torch.cat(outs)


class Llama4MoeParallel(nn.Module):
    """Mixed into Llama 4's MoE block (``Llama4TextMoe``) whose experts are split (hf.py): its router and shared
    expert as HuggingFace runs them, the routed experts through `FusedExpertsParallel.scaled_input_forward`."""

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_scores, router_logits = self.router(hidden_states)
        routed = self.experts.scaled_input_forward(hidden_states, router_scores)
        out = self.shared_expert(hidden_states)
        out.add_(routed)
        return out, router_logits


class ModuleExpertsParallel(_ExpertsParallel):
    """Mixed into a ``SwitchTransformersExperts``-style ModuleDict (``expert_<i>`` modules): this rank's experts
    are whole modules, the others' weights empty pieces (hf.py). Runs an expert exactly when some rank of the
    data-parallel group routed a token to it (module docstring)."""

    @eager_while_traced  # as FusedExpertsParallel's
    def forward(self, hidden_states: torch.Tensor, selected_experts: torch.Tensor,
                routing_weights: torch.Tensor) -> torch.Tensor:
        n, E = hidden_states.shape[0], self.num_experts
        mask = selected_experts.reshape(n, -1, E)
        # (expert, slot, token) of every routed pair, sorted by expert, then slot, then token: HuggingFace's order.
        experts, slots, tokens = torch.nonzero(mask.permute(2, 1, 0), as_tuple=True)
        weights = routing_weights.reshape(n, -1)[tokens, slots]
        used = self._used_anywhere(experts)
        mine = self._local_range()

        def compute(x: torch.Tensor, counts: list[int]) -> torch.Tensor:
            outs = [self[f"expert_{e}"](rows) for e, rows in zip(mine, x.split(counts)) if used[e]]
            # Nothing ran here: the empty rows themselves keep the return trip differentiable, so that every rank
            # of ep calls the backward all-to-all.
            return torch.cat(outs) if outs else x
        out = self._combine(hidden_states, tokens, experts, weights, compute)
        elsewhere = [local(p) for e in range(E) if used[e] and e not in mine
                     for p in self[f"expert_{e}"].parameters() if p.requires_grad]
        return _Attach.apply(out, *elsewhere) if elsewhere and torch.is_grad_enabled() else out

    def _used_anywhere(self, experts: torch.Tensor) -> list[bool]:
        """Whether each expert got a token on some rank of the data-parallel group (a sum of counts over dp)."""
        counts = torch.bincount(experts, minlength=self.num_experts)
        dp = self._sw_ep.dp
        if dp.size > 1:
            counts = counts.to(dp.device)
            dp.all_reduce(counts, ReduceOp.SUM)
        return (counts > 0).tolist()
