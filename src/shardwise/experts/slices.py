"""This rank's experts as parameters that answer for the whole model's, and the gradient hooks they carry.

Expert parallel keeps on each rank of the expert-parallel group `ep` only its experts' weights; the others' become
`ShardedParameter`s holding this rank's part (a slice of a fused (E, ...) tensor, or nothing at all of an expert
module another rank holds) while answering for the one-process shape (sharded_tensor.py), so `model.parameters()`
still looks like the model and the layout contract (layout.py) can place every element.

Two hooks follow each expert weight:

* ``scale_gradient(1 / ep)``: the gradient that reaches an expert on its rank sums the contributions of the rows of
  every rank of its ep group (the backward all-to-all brought them), while a data-parallel strategy then averages
  it over `edp`, the ranks holding the same experts: x 1 / ep makes the result one process's gradient (parallel.py
  derives it; DeepSpeed-MoE, Rajbhandari et al. 2022, arXiv 2201.05596).
* ``gradient_answers_for_whole`` (on a sharded piece): autograd accumulates a plain gradient shaped like the piece;
  the hook re-describes it as the piece of the whole gradient, as the parameter is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..comm.base import Communicator
from ..param_hooks import carry_grad_hooks, hook_even_if_frozen, internal_hook
from ..sharded_tensor import ShardSpec, as_sharded, is_sharded, spec_of

__all__ = ["expert_piece", "gradient_answers_for_whole", "scale_gradient"]


def scale_gradient(factor: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """A gradient hook multiplying the incoming gradient by `factor`."""
    def scale(grad: torch.Tensor) -> torch.Tensor:
        return grad * factor  # follows the parameter if a later strategy replaces it (param_hooks.py)
    return scale


@internal_hook
def gradient_answers_for_whole(param: torch.Tensor) -> None:
    """Autograd accumulated the piece's plain gradient: describe it as the piece of the whole gradient."""
    grad, spec = param.grad, spec_of(param)
    if grad is not None and spec is not None and not is_sharded(grad):
        param.grad = as_sharded(grad, spec)


def expert_piece(old: nn.Parameter, piece: torch.Tensor, name: str, ep: Communicator, who: str) -> nn.Parameter:
    """`piece` (this rank's part of `old`, a fresh tensor) as a ShardedParameter answering for `old`'s shape, with
    `old`'s gradient hooks carried over and the two hooks of the module docstring."""
    spec = ShardSpec(torch.Size(old.shape), name, f"expert parallel (ep={ep.size})")
    new = as_sharded(piece, spec, parameter=True, requires_grad=old.requires_grad)
    carry_grad_hooks(old, new, name, who)
    hook_even_if_frozen(new, "register_hook", scale_gradient(1.0 / ep.size))  # also once unfrozen
    hook_even_if_frozen(new, "register_post_accumulate_grad_hook", gradient_answers_for_whole)
    return new
