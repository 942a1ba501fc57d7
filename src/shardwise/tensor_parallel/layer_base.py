"""The base of the tensor-parallel layers and what they share: split checks, the dense initialisers they slice.

Every layer can be built from a dense layer (``from_dense``) or directly, drawing the full dense weight from a
seeded generator exactly as the dense layer would, then keeping its slice; see `layers.py` for the overview.

Parameters that look like the model's. A split parameter (a column, row or vocabulary slice) is a
`ShardedParameter` (sharded_tensor.py): its storage is this rank's slice and every kernel the layer runs reads that
slice through `local()`, but `shape`, `dim()` and `numel()` answer for the dense tensor, as FSDP2's DTensor
parameters do, and so does its gradient (a post-accumulate-grad hook re-describes the slice autograd produced). A
script's `sum(p.numel() for p in model.parameters())` then counts one process's parameters, weight-decay groups by
`p.dim()` are one process's, and torch's `clip_grad_norm_` / `GradScaler` / pickling of a slice raise, naming the
shardwise way, instead of clipping each rank by its own slice's norm. Replicated parameters (LayerNorms, a
row-parallel bias) stay plain `nn.Parameter`s, as does everything in a group of one.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..comm.base import Communicator
from ..compiled import eager_while_traced
from ..param_hooks import hook_even_if_frozen, internal_hook
from ..sharded_tensor import ShardSpec, as_sharded, is_sharded, local, set_spec, spec_of

__all__ = ["TensorParallelLayer", "check_split", "seeded_generator", "dense_linear_init", "as_param",
           "gradient_answers_for_whole",
           "name_slices"]


def check_split(layer: str, what: str, value: int, parts: int, size: int) -> None:
    if value % (parts * size):
        blocks = f" in {parts} fused blocks" if parts > 1 else ""
        raise ValueError(
            f"{layer}: {what}={value}{blocks} cannot be split across tensor-parallel size {size}; "
            f"{what} must be divisible by {parts * size}"
        )


def seeded_generator(seed: int | None) -> torch.Generator | None:
    return None if seed is None else torch.Generator().manual_seed(seed)


def dense_linear_init(out_features: int, in_features: int, bias: bool, seed: int | None):
    """The full weight and bias nn.Linear would draw (kaiming-uniform with fan_in = in_features), on the CPU."""
    gen = seeded_generator(seed)
    bound = 1.0 / math.sqrt(in_features) if in_features > 0 else 0.0
    # nn.Linear: kaiming_uniform_(a=sqrt(5)) == U(-1/sqrt(fan_in), 1/sqrt(fan_in)); bias the same bound.
    w = torch.empty(out_features, in_features).uniform_(-bound, bound, generator=gen)
    b = torch.empty(out_features).uniform_(-bound, bound, generator=gen) if bias else None
    return w, b


class TensorParallelLayer(nn.Module):
    """Base of the tensor-parallel layers: the group, the sequence-parallel settings, gathering full tensors."""

    comm: Communicator
    sequence_parallel: bool
    sequence_dim: int

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Under torch.compile the forward is a graph break that runs eagerly: the layer computes on this rank's slice
        # of a parameter whose shape says the dense one (sharded_tensor.py), which dynamo's guards do not follow
        # (compiling a split model failed with "Guard failed on the same frame it was created ... size mismatch");
        # the code between the layers (norms, attention, activations) still compiles.
        if "forward" in cls.__dict__:
            cls.forward = eager_while_traced(cls.forward)

    def __deepcopy__(self, memo: dict) -> nn.Module:
        # The layer holds this rank's slices and its group's communicator, which cannot be copied (the copy failed
        # with "cannot pickle '_thread.RLock' object"): say how to get a copy instead.
        raise TypeError(f"copy.deepcopy of a tensor-parallel model ({type(self).__name__} layer): copy the model "
                        f"before splitting it, or load sw.full_state_dict(model) into a plain model")

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter of this layer gathered to its original (dense) shape, by name. Collective."""
        return {name: self.full_tensor(name) for name, _ in self.named_parameters(recurse=False)}

    def full_tensor(self, name: str) -> torch.Tensor:  # pragma: no cover - overridden
        raise NotImplementedError

    def global_shape(self, name: str) -> tuple[int, ...]:
        """The dense shape of parameter `name` (what a full state dict holds)."""
        raise NotImplementedError  # pragma: no cover - overridden

    def boxes(self, name: str, rank: int) -> tuple[tuple[tuple[int, int], ...], ...] | None:
        """The boxes ((start, size) per dim) of the dense tensor that rank `rank`'s `name` covers, in local
        row-major order; None when the parameter is replicated (the layout contract, see shardwise.layout)."""
        raise NotImplementedError  # pragma: no cover - overridden

    def local_layout(self, name: str) -> tuple[int, tuple[int, ...] | None]:
        """(dim along which this rank's boxes are concatenated, permutation its tensor is stored in); see layout.py."""
        return 0, None

    def slices_answer_for_whole(self) -> None:
        """Make each split parameter of this layer a ShardedParameter answering for its dense shape (the module
        docstring says why); its storage, and so every value, stays as it is. Idempotent."""
        if self.comm.size == 1:
            return
        for name, p in list(self.named_parameters(recurse=False)):
            if is_sharded(p) or p.device.type == "meta" or self.boxes(name, self.comm.rank) is None:
                continue
            spec = ShardSpec(torch.Size(self.global_shape(name)), name, f"tensor parallel (tp={self.comm.size})")
            sliced = as_sharded(p, spec, parameter=True, requires_grad=p.requires_grad)
            hook_even_if_frozen(sliced, "register_post_accumulate_grad_hook", gradient_answers_for_whole)
            setattr(self, name, sliced)


@internal_hook
def gradient_answers_for_whole(param: torch.Tensor) -> None:
    """Autograd accumulated a plain slice into `param.grad`: describe it as the slice of the dense gradient."""
    grad, spec = param.grad, spec_of(param)
    if grad is not None and spec is not None and not is_sharded(grad):
        param.grad = as_sharded(grad, spec)


def name_slices(model: nn.Module) -> None:
    """Give every tensor-parallel slice of `model` its name in the model (for the messages that name it)."""
    for name, p in model.named_parameters():
        spec = spec_of(p)
        if spec is not None and spec.what.startswith("tensor parallel"):
            set_spec(p, ShardSpec(spec.shape, name, spec.what))


def as_param(data: torch.Tensor, like: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(local(data), requires_grad=like.requires_grad)
