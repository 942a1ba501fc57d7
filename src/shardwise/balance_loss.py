"""A MoE model's load-balancing loss under `sw.parallelize`: over the global batch in one forward, or per microbatch.

The Switch balance loss of a MoE layer (models/moe.py) is a product of two means over the batch, so a mean of
microbatch losses is another function than the loss of the whole batch. `parallelize` computes it one of two ways:

* one stage and one microbatch (pp = 1, n_microbatches = 1, the default there for such a model): `with_balance_loss`
  adds each layer's loss, over the global batch (its statistics summed over the data-parallel group), to the model's
  loss, as `GPT.forward` does: one process on the whole batch;
* microbatches (pp > 1, or n_microbatches > 1): each microbatch's balance loss is its own, over global microbatch j
  (the j-th microbatch of every data-parallel rank: each forward sums the statistics over the data group), as one
  process accumulating gradients over those microbatches computes it (loss / n_microbatches each), and as
  Megatron-LM computes it per microbatch (Shoeybi et al. 2019; its MoEAuxLossAutoScaler). The layers' losses travel
  with the hidden states from stage to stage (`carry_balance_loss`): the first layer starts a running sum at zero,
  each layer holding MoE layers adds ``moe_aux_loss_coef x aux_loss`` of them, and the loss adds the sum to the last
  stage's loss. Backward carries the sum's gradient back through the stages like any activation (scaled by the
  pipeline's 1 / n_microbatches and the loss scale), and activation checkpointing recomputes it with its layer.

A HuggingFace MoE's router loss is a function of every layer's router logits at once (transformers concatenates them
before taking the means), so it is not a sum over stages: models/hf_router_loss.py carries the per-expert sums it is
made of instead, the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .models.moe import MoE

__all__ = ["balance_layers", "carry_balance_loss", "with_balance_loss", "without_balance_sum"]


def balance_layers(model: nn.Module) -> list[MoE]:
    """The model's MoE layers with a load-balancing loss (moe_aux_loss_coef > 0)."""
    return [m for m in model.modules() if isinstance(m, MoE) and m.aux_loss_coef > 0]


def with_balance_loss(loss_fn: Callable, layers: list[MoE]) -> Callable:
    """`loss_fn` plus each MoE layer's balance loss times its coefficient, as `GPT.forward` adds them: with one stage
    and one microbatch the stage's forward has just set every layer's `aux_loss`, over the global batch (the layers
    sum their statistics over the data-parallel group, and over tp under sequence parallel; models/moe.py)."""
    if not layers:
        return loss_fn

    def loss(output: Any, target: Any) -> torch.Tensor:
        return loss_fn(output, target) + sum(m.aux_loss_coef * m.aux_loss for m in layers)

    return loss


class _CarryBalance(nn.Module):
    """One pipeline layer that passes the running balance-loss sum on: the first layer starts it at zero (in at least
    fp32), every other takes it as its last argument; each adds ``coef x aux_loss`` of the MoE layers inside it."""

    def __init__(self, layer: nn.Module, start: bool) -> None:
        super().__init__()
        self.layer = layer
        self.start = start
        self._moes = [m for m in layer.modules() if isinstance(m, MoE) and m.aux_loss_coef > 0]

    def forward(self, *args: Any, **kwargs: Any) -> tuple:
        if not self.start:
            *args, total = args
        out = self.layer(*args, **kwargs)
        if isinstance(out, dict) or not isinstance(out, (torch.Tensor, tuple)):
            raise ValueError(f"parallelize: the pipeline layer {type(self.layer).__name__} returned "
                             f"{type(out).__name__}; a MoE balance loss over microbatches travels beside a tensor or "
                             f"a tuple of tensors between layers")
        values = out if isinstance(out, tuple) else (out,)
        if self.start:
            first = values[0]
            # Shape (1,), not (): `predict` concatenates the last stage's outputs over microbatches along dim 0.
            total = first.new_zeros(1, dtype=torch.promote_types(first.dtype, torch.float32))
        for moe in self._moes:
            total = total + moe.aux_loss_coef * moe.aux_loss
        return (*values, total)


def carry_balance_loss(layers: Sequence[nn.Module], loss_fn: Callable) -> tuple[list[nn.Module], Callable]:
    """The pipeline layers passing each microbatch's balance-loss sum on, and `loss_fn` of the last layer's output
    plus that sum (module docstring)."""
    carried = [_CarryBalance(layer, start=i == 0) for i, layer in enumerate(layers)]

    def loss(output: tuple, target: Any) -> torch.Tensor:
        *values, total = output
        return loss_fn(values[0] if len(values) == 1 else tuple(values), target) + total.reshape(())

    return carried, loss


def without_balance_sum(output: Any) -> Any:
    """A carrying pipeline's last output without the running sum (what `predict` returns)."""
    if output is None:
        return None
    *values, _ = output
    return values[0] if len(values) == 1 else tuple(values)
