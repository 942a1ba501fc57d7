"""Random fills of a sharded piece that draw what one process would have drawn.

Why. A script that initialises (or re-initialises) parameters after wrapping (`model.apply(init_fn)`,
`head.reset_parameters()`, `nn.init.trunc_normal_(p, std=0.02)`, HuggingFace's `module.weight.data.normal_()`) runs
`normal_` / `uniform_` / ... on what `model.parameters()` yields. Under ZeRO / FSDP / tensor or expert parallel that
is this rank's piece. Run on the piece as it is, every rank would draw its piece's count of numbers from the same
generator state: each piece would hold the first numbers of the stream (identical pieces on every rank of a flat
split, identical slices of every tensor-parallel rank), and each generator would advance by the piece's count
instead of the tensor's, so every later draw (dropout) would differ from one process too. Silently wrong.

Mechanism. The fill runs on a whole tensor of the parameter's shape, dtype and device, with the same arguments and
generator (torch's CPU kernels, and CUDA's Philox, give a tensor's values as a function of its shape and the
generator state), and this rank keeps its own elements: the `held` map of the piece's placement (`layout.held_views`:
each (global box, view) pair of the piece), set when a strategy declares its placements. Every rank advances its
generator exactly as one process does. This is what Megatron-LM's `_initialize_affine_weight_cpu` does for tensor
parallel weights (draw the master weight, keep the slice); FSDP2 instead offsets CUDA's Philox per shard
(`OffsetBasedRNGTracker`), which spares the whole-size temporary but matches one device only on CUDA. The cost is
one whole tensor per fill, freed at once (one parameter at a time: the largest parameter's size, not the model's).

The four initialisers of `torch.nn.init` that dispatch to a tensor subclass themselves (`uniform_`, `normal_`,
`constant_`, `kaiming_uniform_`, which `nn.Linear.reset_parameters` calls) run on the whole tensor the same way;
the others (`trunc_normal_`, `xavier_*`, `kaiming_normal_`) reach the piece as `uniform_` / `normal_` and
elementwise operations. `rand_like` / `randn_like` / `randint_like` of a piece (noise added to parameters) are
drawn the same way and return a piece. A fill whose piece has no known place (a gradient, a tensor computed from a piece) or that reads
another tensor elementwise (`bernoulli_(probabilities)`) is refused, naming the parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .boxes import box_slices

__all__ = ["RANDOM_FILLS", "RANDOM_LIKE", "drawn_as_one_process"]

RANDOM_FILLS = frozenset({"normal_", "uniform_", "bernoulli_", "exponential_", "random_", "log_normal_",
                          "geometric_", "cauchy_"})
RANDOM_LIKE = frozenset({"rand_like", "randn_like", "randint_like"})


def drawn_as_one_process(func: Any, plain_piece: torch.Tensor, spec: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """This rank's elements of `func(whole, *args[1:], **kwargs)` for a whole tensor of `spec.shape`, in a plain tensor
    shaped like `plain_piece` (its dtype: the fill's; a `*_like` call's own `dtype=`). `args[0]` is the piece."""
    name = getattr(func, "__name__", str(func))
    held: Callable[[torch.Tensor], list] | None = spec.held
    if held is None:
        raise RuntimeError(
            f"{name}() on {spec.name}, a {spec.what} piece whose place in the whole tensor is not known here (a "
            f"gradient, or a tensor computed from a piece): its numbers would differ from one process's. Fill the "
            f"parameter itself (nn.init.normal_(p), p.data.normal_()), whose place its strategy declared")
    others = (*args[1:], *(v for k, v in kwargs.items() if args or k != "tensor"))
    if any(isinstance(a, torch.Tensor) and a.dim() for a in others):
        raise RuntimeError(
            f"{name}() on {spec.name}, a {spec.what} piece, with a tensor argument: the draw would need that tensor "
            f"whole. Draw on a whole tensor (sw.full_state_dict(model)) and load it, or fill before wrapping")
    template = torch.empty(spec.shape, dtype=plain_piece.dtype, device=plain_piece.device)
    with torch.no_grad():
        whole = template
        if not args:  # torch.nn.init's uniform_, normal_, constant_, kaiming_uniform_ take the tensor by name
            func(**{**kwargs, "tensor": template})
        elif name in RANDOM_LIKE:
            whole = func(template, *args[1:], **kwargs)
        else:
            func(template, *args[1:], **kwargs)
        out = torch.empty(plain_piece.shape, dtype=whole.dtype, device=whole.device)
        for box, view in held(out):
            view.copy_(whole[box_slices(box)])
    return out
