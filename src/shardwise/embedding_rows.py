"""nn.Embedding's per-row options under data parallelism: `max_norm` over every rank's rows, `sparse` refused.

`nn.Embedding(max_norm=c)` (and `nn.EmbeddingBag`) renormalises in place, inside every forward, each row that the
input looks up whose norm exceeds c (`torch.embedding_renorm_`; the renormalised weight is then what the optimizer
updates). One process renormalises the rows of the whole batch. Under data parallelism each rank would
renormalise only the rows of its own slice: the replicas' weights drift apart and none is one process's (torch DDP
does so silently: 0.008 off one process after four AdamW steps; ZeRO-3 wrote into the gathered copy and lost it,
2.7 off).

Here every forward of such a layer first marks the rows that any rank looks up (one all-reduce, MAX, of one byte per
row of the table) and renormalises that union in the layer's weight, then looks up with `max_norm` set aside for the
call, so each row is renormalised once per forward as in one process. Every rank must therefore run every forward of
the model, evaluation included (docs/guide.md: evaluate on every rank). The write must reach the parameter the
optimizer updates: it does under DDP and under ZeRO-1/2 and FSDP `no_shard` in the parameters' dtype without
offload (the whole parameters kept between steps are the master's storage); where the forward writes a gathered
copy that is freed or re-gathered (ZeRO-3, FSDP full/hybrid shard and shard_grad_op, mixed precision, CPU offload)
the layer is refused at wrap time.

`sparse=True` layers produce sparse gradients, which the data-parallel reductions (flat buffers, buckets) do not
carry: refused at wrap time, naming the layer (use dense gradients; `torch.optim.SparseAdam` needs sparse ones).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from .comm.base import Communicator, ReduceOp

__all__ = ["check_embedding_rows"]

_LAYERS = (nn.Embedding, nn.EmbeddingBag)


def check_embedding_rows(model: nn.Module, comm: Communicator, who: str,
                         writes_reach_master: Callable[[torch.dtype], bool] = lambda dtype: True,
                         sparse_alone: bool = False) -> None:
    """At wrap time, before `who` records `model` (data parallel over `comm`): refuse sparse layers, and make
    max_norm layers renormalise every rank's rows, or refuse them where `writes_reach_master(weight dtype)` is False
    (the layout's forward writes a copy, and the write would be lost). `sparse_alone`: a group of one takes sparse
    gradients (ZeRO/FSDP hand autograd's gradients to the optimizer as they are). See the module docstring."""
    for name, layer in model.named_modules():
        if not isinstance(layer, _LAYERS):
            continue
        what = f"{type(layer).__name__} {name or '<root>'!r}"
        if layer.sparse and not (sparse_alone and comm.size == 1):
            raise ValueError(f"{who}: {what} has sparse=True: its sparse gradients cannot be averaged over the "
                             f"data-parallel ranks here (flat gradient buffers); use sparse=False (an optimizer "
                             f"such as Adam or AdamW instead of SparseAdam)")
        if layer.max_norm is None or comm.size == 1:
            continue
        if not writes_reach_master(layer.weight.dtype):
            raise ValueError(f"{who}: {what} has max_norm={layer.max_norm}: its forward renormalises the rows it "
                             f"looks up in place, in a gathered copy of the weight that this layout frees or "
                             f"re-gathers, so the write would be lost. Use sw.DDP, or ZeRO stage 1/2 (FSDP "
                             f"no_shard) in the parameters' dtype without CPU offload (where it is exact), or drop "
                             f"max_norm")
        renorm = RowsOfAllRanks(comm)
        layer.register_forward_pre_hook(renorm.before)
        layer.register_forward_hook(renorm.after, always_call=True)


class RowsOfAllRanks:
    """The hooks of one max_norm layer: renormalise the union of every rank's looked-up rows before the lookup, and
    set max_norm aside for the call (restored afterwards, also when the forward raises)."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.max_norm: float | None = None

    def before(self, layer: nn.Module, args: tuple) -> None:
        indices = args[0] if args else None
        if not isinstance(indices, torch.Tensor) or layer.max_norm is None:
            return  # keywords only (torch's own check will speak), or set aside already by a re-entrant call
        weight = layer.weight
        rows = torch.zeros(weight.shape[0], dtype=torch.uint8, device=self.comm.device)
        rows[indices.reshape(-1).to(self.comm.device)] = 1
        self.comm.all_reduce(rows, ReduceOp.MAX)
        with torch.no_grad():
            torch.embedding_renorm_(weight, rows.nonzero().reshape(-1).to(weight.device), layer.max_norm,
                                    layer.norm_type)
        self.max_norm, layer.max_norm = layer.max_norm, None

    def after(self, layer: nn.Module, args: tuple, output: Any) -> None:
        if self.max_norm is not None:
            layer.max_norm, self.max_norm = self.max_norm, None
