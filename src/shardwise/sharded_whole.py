"""A sharded piece meeting the whole tensor: random fills drawn as one process draws them, and whole-shaped operands
cut to this rank's elements.

Both rest on the piece's place in its whole tensor, `ShardSpec.held` (`layout.held_views` of the placement its
strategy declared: each (global box, view) pair of the piece), and on `this_ranks_part`, which fills a tensor shaped
like the piece with those elements of a whole-shaped one.

Random fills. A script that initialises (or re-initialises) parameters after wrapping (`model.apply(init_fn)`,
`head.reset_parameters()`, `nn.init.kaiming_uniform_(p)`, HuggingFace's `module.weight.data.normal_()`) runs
`normal_` / `uniform_` / ... on what `model.parameters()` yields: under ZeRO / FSDP / tensor or expert parallel,
this rank's piece. Run on the piece as it is, every rank would draw its piece's count of numbers from the same
generator state: each piece would hold the first numbers of the stream (identical pieces on every rank of a flat
split, identical slices on every tensor-parallel rank), and each generator would advance by the piece's count
instead of the tensor's, so every later draw (dropout) would differ from one process too. Silently wrong. Instead
the fill runs on a whole tensor of the parameter's shape, dtype and device, with the same arguments and generator
(a tensor's values are a function of its shape and the generator state), and the rank keeps its own elements;
every rank advances its generator exactly as one process does. This is what Megatron-LM's
`_initialize_affine_weight_cpu` does for tensor-parallel weights (draw the master weight, keep the slice); FSDP2
instead offsets CUDA's Philox per shard (`OffsetBasedRNGTracker`), which spares the whole-size temporary but matches
one device only on CUDA. The cost is one whole tensor per fill, freed at once (one parameter at a time).
The four initialisers of `torch.nn.init` that dispatch to a tensor subclass themselves (`uniform_`, `normal_`,
`constant_`, `kaiming_uniform_`, which `nn.Linear.reset_parameters` calls) run on the whole tensor the same way;
the others (`xavier_*`, `kaiming_normal_`, timm's `trunc_normal_`) reach the piece as `uniform_` / `normal_` and
elementwise operations. `rand_like` / `randn_like` / `randint_like` of a piece return a piece drawn the same way.
A fill whose piece has no known place or that reads another tensor elementwise (`bernoulli_(probabilities)`) is
refused, naming the parameter.

Whole-shaped operands. `p.copy_(pretrained)` (weights loaded into a wrapped model), `p.add_(delta)` (a LoRA merge,
task arithmetic), `p.mul_(mask)` (a pruning mask), `w.mul_(scale[:, None])` (a folded BatchNorm): an elementwise
operation of a piece with a plain tensor of the parameter's shape, or one that broadcasts to it, means that
tensor's elements at the piece's place. The operand is expanded to the whole shape and this rank's part of it taken
(`this_ranks_part`), so the result is one process's; the cost is one piece-sized copy per such operand. Refused
still (sharded_tensor.py): an in-place operation whose target is the whole tensor (`ema.lerp_(p)`: a whole copy
updated from a piece) and the `torch._foreach_*` lists.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .boxes import box_slices

__all__ = ["RANDOM_FILLS", "RANDOM_LIKE", "drawn_as_one_process", "this_ranks_part", "fits_whole", "is_initialiser"]

RANDOM_FILLS = frozenset({"normal_", "uniform_", "bernoulli_", "exponential_", "random_", "log_normal_",
                          "geometric_", "cauchy_"})
RANDOM_LIKE = frozenset({"rand_like", "randn_like", "randint_like"})
_INITIALISERS = frozenset({"uniform_", "normal_", "constant_", "ones_", "zeros_", "kaiming_uniform_",
                           "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "trunc_normal_"})


def is_initialiser(func: Any) -> bool:
    """Whether `func` is one of torch.nn.init's initialisers, which dispatch to a tensor subclass with the tensor
    passed by name (`uniform_`, `normal_`, `constant_`, `kaiming_uniform_` in torch 2.13), or a library's stand-in
    for one: transformers (`transformers.initialization`) replaces torch.nn.init's functions module-wide while it
    builds a model, and when two threads build at once (thread ranks) the replacement can outlive both builds, so
    the function dispatched is transformers' (which calls torch's) rather than torch's own."""
    module = getattr(func, "__module__", None) or ""
    return getattr(func, "__name__", "") in _INITIALISERS and module.rsplit(".", 1)[-1] in ("init", "initialization")


def this_ranks_part(whole: torch.Tensor, spec: Any, plain_piece: torch.Tensor) -> torch.Tensor:
    """This rank's elements of `whole` (the parameter's shape, or one that broadcasts to it), in a new plain tensor
    shaped like `plain_piece`, of `whole`'s dtype and `plain_piece`'s device."""
    held: Callable[[torch.Tensor], list] = spec.held
    whole = whole.expand(spec.shape)
    out = torch.empty(plain_piece.shape, dtype=whole.dtype, device=plain_piece.device)
    with torch.no_grad():
        for box, view in held(out):
            view.copy_(whole[box_slices(box)])
    return out


def fits_whole(shape: torch.Size, spec: Any) -> bool:
    """Whether a tensor of `shape` is the whole parameter's shape or broadcasts to it (and so can be cut)."""
    try:
        return torch.broadcast_shapes(shape, spec.shape) == spec.shape
    except RuntimeError:
        return False


def drawn_as_one_process(func: Any, plain_piece: torch.Tensor, spec: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """This rank's elements of `func(whole, *args[1:], **kwargs)` for a whole tensor of `spec.shape`, in a plain tensor
    shaped like `plain_piece` (its dtype: the fill's; a `*_like` call's own `dtype=`). `args[0]` is the piece (or,
    for torch.nn.init's functions, `kwargs["tensor"]`)."""
    name = getattr(func, "__name__", str(func))
    if spec.held is None:
        raise RuntimeError(
            f"{name}() on {spec.name}, a {spec.what} piece whose place in the whole tensor is not known here (a "
            f"gradient, or a tensor computed from a piece): its numbers would differ from one process's. Fill the "
            f"parameter itself (nn.init.normal_(p), p.data.normal_()), whose place its strategy declared")
    others = (*args[1:], *(v for k, v in kwargs.items() if args or k != "tensor"))
    if any(isinstance(a, torch.Tensor) and a.dim() for a in others):
        raise RuntimeError(
            f"{name}() on {spec.name}, a {spec.what} piece, with a tensor argument: the draw would need that tensor "
            f"whole. Draw on a whole tensor (sw.full_state_dict(model)) and load it, or fill before wrapping")
    whole = torch.empty(spec.shape, dtype=plain_piece.dtype, device=plain_piece.device)
    with torch.no_grad():
        if not args:  # torch.nn.init's uniform_, normal_, constant_, kaiming_uniform_ take the tensor by name
            func(**{**kwargs, "tensor": whole})
        elif name in RANDOM_LIKE:
            whole = func(whole, *args[1:], **kwargs)
        else:
            func(whole, *args[1:], **kwargs)
    return this_ranks_part(whole, spec, plain_piece)
