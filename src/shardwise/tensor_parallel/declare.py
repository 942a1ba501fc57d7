"""What tensor parallelism tells the layout contract: each parameter's dense shape and the boxes this rank holds.

A parameter of a tensor-parallel layer (column-, row- or vocabulary-parallel) covers boxes of the dense tensor that
the layer itself reports (`TensorParallelLayer.boxes`); a column split of k fused blocks covers k boxes. Every
other parameter (LayerNorms, a row-parallel bias, position embeddings) is replicated over the tensor-parallel group;
under sequence parallel those that act on sequence shards carry a partial gradient summed over the group.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from .. import layout
from ..comm.base import Communicator
from .layers import TensorParallelLayer
from .sequence_parallel import is_sequence_parallel_param

__all__ = ["tensor_parallel_placements"]


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (model.get_submodule(path) if path else model), attr


def tensor_parallel_placements(model: nn.Module, comm: Communicator,
                               head_rows: dict[int, tuple] | None = None) -> dict[str, layout.Placement]:
    """The placements of a model `parallelize` has just split over `comm` (see the module docstring); head_rows:
    id(parameter) -> every rank's boxes of the "head_rows" parameters (head_rows.py), split along dim 0."""
    out: dict[str, layout.Placement] = {}
    head_rows = head_rows or {}
    for name, pl in layout.placements(model).items():
        if id(pl.param) in head_rows and comm.size > 1:
            by_rank = head_rows[id(pl.param)]
            out[name] = dataclasses.replace(pl, boxes=by_rank[comm.rank], box_group=comm, boxes_by_rank=by_rank,
                                            concat_dim=0)
            continue
        split = [(m, a) for m, a in map(lambda n: _owner(model, n), pl.names)
                 if isinstance(m, TensorParallelLayer) and m.boxes(a, comm.rank) is not None]
        if split and comm.size > 1:
            owner, attr = split[0]
            concat_dim, perm = owner.local_layout(attr)
            out[name] = dataclasses.replace(
                pl, shape=tuple(owner.global_shape(attr)), boxes=owner.boxes(attr, comm.rank), box_group=comm,
                boxes_by_rank=tuple(owner.boxes(attr, r) for r in range(comm.size)), concat_dim=concat_dim,
                stored_perm=perm)
        elif comm.size > 1:
            partial = comm if is_sequence_parallel_param(pl.param) else None
            out[name] = dataclasses.replace(pl, replicated_over=(*pl.replicated_over, comm), partial_grad_over=partial)
        else:
            out[name] = pl
    return out
