"""Parameters with one row per attention head, kept by each tensor-parallel rank for its own heads (style
``"head_rows"`` / `HeadRows`).

Column-parallel q/k/v projections give rank r of tp the heads ``[r H / tp, (r + 1) H / tp)``. A parameter of the
attention module itself with one row per head, such as GPT-OSS's attention ``sinks`` (H,) (one extra logit per head
in every softmax denominator; Xiao et al. 2023, arXiv 2309.17453), is read by the attention as a whole tensor of
the heads it computes: each rank keeps the rows of its heads, as a ShardedParameter answering for (H, ...) (the
layout places its boxes along dim 0 over tp, so `sw.full_state_dict`, clipping and checkpoints see one tensor). A
head's row touches only that head's outputs, which its rank computes in full, so its gradient is complete on that
rank: no reduction over tp (unlike `Heads`, whose replicated weights every rank applies to its own heads). The
module's own forward (HuggingFace's code, which reshapes the sinks) reads this rank's rows as a plain tensor: its
class is swapped for one whose forward puts `local(rows)`, a differentiable view, in place of each parameter for
the duration of the call (`HeadRowsForward`).
torchtitan shards GPT-OSS's sinks the same way, as a DTensor Shard(0) over the tensor-parallel mesh.
"""

from __future__ import annotations

import torch
from torch import nn

from typing import Any

from .._mixin import mix_in
from ..comm.base import Communicator
from ..param_hooks import carry_grad_hooks, hook_even_if_frozen
from ..sharded_tensor import ShardSpec, as_sharded, local
from .layer_base import gradient_answers_for_whole

__all__ = ["HeadRowsForward", "slice_head_rows"]


class HeadRowsForward:
    """Mixed into a module with "head_rows" parameters: its forward sees this rank's rows as plain tensors (views
    that carry the gradient to the parameter), which the code written for the dense module indexes and reshapes."""

    _sw_head_rows: tuple[str, ...]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        held = {name: self._parameters[name] for name in self._sw_head_rows}
        try:
            for name, param in held.items():
                self._parameters[name] = local(param)
            return super().forward(*args, **kwargs)
        finally:
            self._parameters.update(held)

Boxes = tuple[tuple[tuple[int, int], ...], ...]


def slice_head_rows(module: nn.Module, name: str, comm: Communicator,
                    replaced: dict[int, tuple[nn.Parameter, str]]) -> dict[int, tuple[Boxes, ...]]:
    """Replace each own parameter of `module` (named `name` in the model) by this rank's rows, in place; record each
    in `replaced` (id(old) -> (new, name)). Returns id(new) -> the boxes of every rank. ValueError when a parameter's
    rows do not divide by the group size."""
    out: dict[int, tuple[Boxes, ...]] = {}
    tp = comm.size
    names = tuple(attr for attr, _ in module.named_parameters(recurse=False))
    for attr, old in list(module.named_parameters(recurse=False)):
        full = f"{name}.{attr}"
        if old.dim() == 0 or old.shape[0] % tp:
            raise ValueError(f"parallelize: {full} of shape {tuple(old.shape)} is a \"head_rows\" parameter, one row "
                             f"per head, but tp={tp} does not divide its {old.shape[0] if old.dim() else 0} rows")
        per = old.shape[0] // tp
        with torch.no_grad():
            piece = old.detach()[comm.rank * per:(comm.rank + 1) * per].clone()
        spec = ShardSpec(torch.Size(old.shape), full, f"tensor parallel (tp={tp})")
        new = as_sharded(piece, spec, parameter=True, requires_grad=old.requires_grad)
        carry_grad_hooks(old, new, full, "parallelize")
        hook_even_if_frozen(new, "register_post_accumulate_grad_hook", gradient_answers_for_whole)
        setattr(module, attr, new)
        replaced[id(old)] = (new, full)
        rest = tuple((0, n) for n in old.shape[1:])
        out[id(new)] = tuple((((r * per, per), *rest),) for r in range(tp))
    object.__setattr__(module, "_sw_head_rows", names)
    mix_in(module, HeadRowsForward, "HeadRows")
    return out
