"""Mixtral's load-balancing loss over the global batch when the batch is split over data-parallel ranks.

``MixtralForCausalLM`` with ``output_router_logits=True`` adds ``router_aux_loss_coef x aux`` to its loss, where
(HuggingFace's ``load_balancing_loss_func``, Switch Transformer's loss, Fedus et al. 2021, arXiv 2101.03961)::

    aux = E x sum_i f_i x P_i,   f_i = (top-k assignments to expert i) / rows,   P_i = (sum of probs of i) / rows

with the counts, probability sums and rows summed over all MoE layers (and weighted by the attention mask when one is
given). f and P are means over the batch, and their product is not a mean over rows: each rank computing it on its
own rows gets another number than one process on the global batch, and the data-parallel average of the ranks'
losses is not one process's loss. `GlobalRouterLoss` (mixed into the top-level model by `expert_parallel` when the
batch is split) recomputes it from the router logits the model returns, with the counts and rows summed over the
data-parallel group (all-reduce) and the probability sums through `sum_over_ranks`, whose backward sums the
gradients too (ops.py: the data-parallel mean of the ranks' gradients is then one process's), and replaces
HuggingFace's local term: ``loss + coef x (global - local)``, so the local term's gradient cancels exactly.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn

from .._mixin import mix_in
from ..comm.base import Communicator, ReduceOp
from .hf_kinds import GLOBAL_AUX, ROW_LOCAL_AUX, computes_router_loss, global_aux_model, is_one_of, model_forward
from .ops import sum_over_ranks

__all__ = ["GlobalRouterLoss", "LocalRouterLossRefused", "balance_loss_of", "call_arguments", "global_balance_loss",
           "refuse_local_router_losses", "router_logits_requested", "router_statistics", "share_router_losses"]


#: The attributes under which transformers' MoE models keep their load-balancing coefficient (JetMoE's is its own).
_COEFFICIENTS = ("router_aux_loss_coef", "aux_loss_coef")


def _coefficient(module: nn.Module) -> tuple[str, float] | None:
    """(name, value) of the module's load-balancing coefficient, None when it has none."""
    for name in _COEFFICIENTS:
        if hasattr(module, name):
            return name, getattr(module, name)
    return None


def _balance_loss_model(module: nn.Module) -> bool:
    """Whether `module` is a HuggingFace MoE model (its config has ``output_router_logits``; shardwise's MoE layer
    keeps an ``aux_loss_coef`` of its own) that computes a load-balancing loss with its router logits on: a
    coefficient > 0, or a forward that returns ``aux_loss`` (hf_kinds `computes_router_loss`; the coefficient may
    be 0 while a script adds ``out.aux_loss`` with a coefficient of its own)."""
    if not hasattr(getattr(module, "config", None), "output_router_logits"):
        return False
    coefficient = _coefficient(module)
    return bool(coefficient and coefficient[1]) or computes_router_loss(module)


def _local_router_loss(module: nn.Module) -> bool:
    """Whether `module` computes a load-balancing loss (`_balance_loss_model`) that `share_router_losses` cannot
    make the global batch's: neither Mixtral's loss (hf_kinds `global_aux_model`) nor router losses that are means
    over sequences (Switch Transformers)."""
    return _balance_loss_model(module) and not isinstance(module, GlobalRouterLoss) \
        and not global_aux_model(module) and not is_one_of(module, ROW_LOCAL_AUX)


def _local_router_loss_error(module: nn.Module, ranks: int, who: str, how: str) -> ValueError:
    coefficient = _coefficient(module)
    has = f"{coefficient[0]}={coefficient[1]}" if coefficient else "a load-balancing loss (aux_loss)"
    return ValueError(f"{who} over {ranks} ranks: {type(module).__name__} has {has} {how}; its load-balancing loss "
                      f"(added to its loss, and returned as aux_loss) is a product of batch means, which each rank "
                      f"would compute on its own rows; set output_router_logits=False (made the global batch's: "
                      f"{list(GLOBAL_AUX)} and models whose forward is its forward, Qwen2/3-MoE, OLMoE ...; "
                      f"{list(ROW_LOCAL_AUX)}, whose router losses are means over sequences)")


def refuse_local_router_losses(model: nn.Module, batch_group: Communicator, who: str) -> None:
    """Before a data-parallel wrapper or `expert_parallel` changes anything: a model inside `model` that computes a
    load-balancing loss in its own way (JetMoE, DBRX, a script's subclass with a forward of its own) with
    `output_router_logits` on in its config would have each rank compute that product of batch means on its own rows:
    a ValueError naming it. With the logits off, the model wraps, and `share_router_losses` refuses a call that turns
    them on."""
    if batch_group.size <= 1:
        return
    for module in model.modules():
        if _local_router_loss(module) and getattr(getattr(module, "config", None), "output_router_logits", False):
            raise _local_router_loss_error(module, batch_group.size, who, "with output_router_logits on")


def share_router_losses(model: nn.Module, batch_group: Communicator, who: str) -> None:
    """Make the load-balancing loss of every HuggingFace model inside `model` whose loss is Mixtral's (hf_kinds
    `global_aux_model`) the global batch's over `batch_group`, the ranks that split the batch: `GlobalRouterLoss`
    mixed in. A model whose loss cannot be made so (`refuse_local_router_losses`) gets `LocalRouterLossRefused`,
    which refuses a forward with output_router_logits on. Called by every data-parallel wrapper
    (batch_split.share_batch_split) and by expert_parallel; a model that has either already keeps the group it was
    given first (expert_parallel's, which spans the whole batch)."""
    if batch_group.size <= 1:
        return
    for module in model.modules():
        if isinstance(module, (GlobalRouterLoss, LocalRouterLossRefused)) or not _balance_loss_model(module):
            continue
        if global_aux_model(module):
            mix_in(module, GlobalRouterLoss, "GlobalRouterLoss")
            module._sw_batch_group = batch_group
        elif _local_router_loss(module):
            mix_in(module, LocalRouterLossRefused, "LocalRouterLossRefused")
            module._sw_refused_by = (who, batch_group.size)


def call_arguments(model: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The model's own arguments of a call, by name: bound to its HuggingFace forward (hf_kinds `model_forward`),
    not to a wrapper's ``*args, **kwargs`` mixed in beneath this class (DDP's), where every keyword would hide."""
    return _signature(model_forward(model)).bind(model, *args, **kwargs).arguments


@functools.lru_cache(maxsize=None)
def _signature(forward: Any) -> inspect.Signature:
    return inspect.signature(forward)  # once per forward function: call_arguments runs at every forward


def router_logits_requested(config: Any, given: dict[str, Any]) -> bool:
    """Whether a call of a HuggingFace MoE model returns router logits (and so adds its load-balancing loss): its
    `output_router_logits` argument, else its config's."""
    requested = given.get("output_router_logits")
    return bool(config.output_router_logits if requested is None else requested)


def router_statistics(gate_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int,
                      attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """What HuggingFace's ``load_balancing_loss_func`` sums over the tokens of `gate_logits` (one (tokens, E) tensor
    per MoE layer, tokens in row-major (B, T) order): ``[top-k assignments per expert (E), tokens (1), router
    probabilities per expert (E)]``, each token weighted by `attention_mask` (B, T) when given (0 on padding). Sums
    over several layers, microbatches or ranks add up; `balance_loss_of` finishes the formula. In the logits' dtype
    promoted to at least float32; only the probabilities carry a gradient."""
    device = gate_logits[0].device
    dtype = torch.promote_types(gate_logits[0].dtype, torch.float32)
    counts = torch.zeros(num_experts, dtype=dtype, device=device)
    probs = torch.zeros(num_experts, dtype=dtype, device=device)
    rows = torch.zeros(1, dtype=dtype, device=device)
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=dtype)
    for logits in gate_logits:
        weights = torch.softmax(logits.to(device), dim=-1)  # in the logits' dtype, as HuggingFace's
        _, selected = torch.topk(weights, top_k, dim=-1)
        ones = mask if mask is not None else torch.ones(weights.shape[0], dtype=dtype, device=device)
        counts = counts + torch.zeros_like(counts).scatter_add_(0, selected.reshape(-1), ones.repeat_interleave(top_k))
        probs = probs + (weights.to(dtype) if mask is None else weights.to(dtype) * mask.unsqueeze(-1)).sum(dim=0)
        rows = rows + ones.sum()
    return torch.cat([counts, rows, probs])


def balance_loss_of(statistics: torch.Tensor, num_experts: int, dp: Communicator) -> torch.Tensor:
    """HuggingFace's load-balancing loss ``E x sum_i f_i x P_i`` of `router_statistics` summed over the ranks of `dp`
    (the counts and tokens by an all-reduce, the probabilities through `sum_over_ranks`, whose backward sums the
    gradients too). f is a float32 mean, as HuggingFace's ``tokens_per_expert``. Collective over `dp`."""
    device = statistics.device
    totals = statistics[:num_experts + 1].detach().to(dp.device, copy=True)
    dp.all_reduce(totals, ReduceOp.SUM)
    totals = totals.to(device)
    probs = sum_over_ranks(statistics[num_experts + 1:], dp)
    tokens = totals[-1]
    assigned = (totals[:-1].float() / tokens.float()).to(probs.dtype)
    return torch.sum(assigned * (probs / tokens)) * num_experts


def global_balance_loss(gate_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int,
                        attention_mask: torch.Tensor | None, dp: Communicator) -> torch.Tensor:
    """HuggingFace's Mixtral ``load_balancing_loss_func`` over the batch of every rank of `dp` (module docstring).
    Collective over `dp`."""
    return balance_loss_of(router_statistics(gate_logits, num_experts, top_k, attention_mask), num_experts, dp)


class GlobalRouterLoss(nn.Module):
    """Mixed into a ``MixtralForCausalLM`` by `expert_parallel` (dp > 1): its ``aux_loss`` and ``loss`` are the global
    batch's (module docstring). `_sw_batch_group` is the data-parallel group."""

    _sw_batch_group: Communicator

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = super().forward(*args, **kwargs)
        given = call_arguments(self, args, kwargs)
        if not router_logits_requested(self.config, given):
            return out
        if not isinstance(out, dict) or getattr(out, "aux_loss", None) is None:
            raise ValueError(f"expert_parallel: {type(self).__name__} returned {type(out).__name__} with "
                             f"output_router_logits=True; the load-balancing loss can be made the global batch's "
                             f"only on its ModelOutput: call it with return_dict=True (the default)")
        local_aux = out.aux_loss
        out.aux_loss = global_balance_loss(out.router_logits, self.num_experts, self.num_experts_per_tok,
                                           given.get("attention_mask"), self._sw_batch_group)
        if out.loss is not None:
            out.loss = out.loss + self.router_aux_loss_coef * (out.aux_loss - local_aux).to(out.loss.device)
        return out


class LocalRouterLossRefused(nn.Module):
    """Mixed into a model whose load-balancing loss cannot be made the global batch's (Granite-MoE) by
    `share_router_losses`: a forward that turns output_router_logits on (its argument, or the config changed after
    wrapping) raises before computing anything. `_sw_refused_by` is (the wrapper's name, its number of ranks)."""

    _sw_refused_by: tuple[str, int]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if router_logits_requested(self.config, call_arguments(self, args, kwargs)):
            who, ranks = self._sw_refused_by
            raise _local_router_loss_error(self, ranks, who, "and this call turns output_router_logits on")
        return super().forward(*args, **kwargs)
