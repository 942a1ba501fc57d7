"""After a compressed data-parallel reduction under `sw.parallelize`, every copy of a parameter takes the same step.

Used by hybrid.HybridModel.step once per step when `compression=` is given (see `average_copies_gradients`).
"""

from __future__ import annotations

from . import layout
from .comm.base import Communicator, ReduceOp
from .pipeline import Pipeline

__all__ = ["average_copies_gradients"]


def average_copies_gradients(pipe: Pipeline, tp_group: Communicator) -> None:
    """After a compressed reduction, make every copy of a parameter take the same step again: the copies of a
    weight tied across pipeline ranks (a GPT's embedding and head), and a parameter replicated over the tensor-
    parallel ranks (biases of row-parallel layers, LayerNorms, position embeddings). Their gradients entered the
    reduction equal (the pipeline summed the tied copies; tensor-parallel ranks compute the same gradient for a
    replicated weight), but each rank's compressor treats its copy as part of its own buckets (TopK ranks it
    against the rank's other gradients, which differ across tp ranks; PowerSGD's and OneBit's residuals are the
    rank's own), so the results differ and the copies would drift apart (and a checkpoint, which saves one copy,
    would not resume the run). Averaging the results over the copies' ranks keeps them equal; each rank's
    residual still tracks its own error, so the average tracks the true gradient too. Costs one all-reduce of
    the tied and replicated parameters per step, in fp32 (small next to the matrices compression is for)."""
    for _, params, group in pipe.tied.groups:
        for p in params:
            if p.requires_grad and p.grad is not None:
                group.all_reduce(p.grad, ReduceOp.AVG)
    if tp_group.size == 1:
        return
    for stage in pipe.stages.values():  # the same stages, parameters and order on every tp rank
        for pl in layout.placements(stage).values():
            if pl.tied_over is None and any(g is tp_group for g in pl.replicated_over) \
                    and pl.param.requires_grad and pl.param.grad is not None:
                tp_group.all_reduce(pl.param.grad, ReduceOp.AVG)
