"""What `sw.parallelize` never runs: the model's own forward, and the hooks on the model itself.

`parallelize` builds its pipeline stages from the model's layers (`pipeline_layers()`, or the layers of a known
HuggingFace decoder: models/hf_parallel.py) and calls those, in order, with the step's microbatches; the model's own
`forward` is not called, at any pp. A forward hook or pre-hook registered on the model itself, or a subclass that
overrides `forward` (an extra term, a changed input) but inherits the layers, would therefore be skipped silently: a
pre-hook that updated a statistic never ran under `sw.parallelize` while it ran in one process. `refuse_skipped_forward`
raises instead, naming what would not run; hooks on the layers (blocks, embeddings) run as in one process.
"""

from __future__ import annotations

from torch import nn

__all__ = ["refuse_skipped_forward"]


def refuse_skipped_forward(model: nn.Module, built_from: type | None) -> None:
    """ValueError when `model` has forward hooks of its own, or overrides the forward of `built_from` (the class
    whose forward the pipeline layers reproduce; None: the model's own layers, nothing to compare)."""
    hooks = [kind for kind, table in (("forward pre-hook", model._forward_pre_hooks),
                                      ("forward hook", model._forward_hooks)) if table]
    if hooks:
        raise ValueError(f"parallelize: {type(model).__name__} has a {hooks[0]} on the model itself; parallelize runs "
                         f"the model's layers in pipeline stages and never calls the model's forward, so it would not "
                         f"run. Register it on a layer (a block, the embeddings), or compute it in loss_fn")
    if built_from is not None and type(model).forward is not built_from.forward:
        raise ValueError(f"parallelize: {type(model).__name__} overrides forward of {built_from.__name__}; parallelize "
                         f"runs the layers of {built_from.__name__} in pipeline stages and never calls the model's "
                         f"forward, so the override would not run. Move the change into a layer (or loss_fn), or "
                         f"give the model a pipeline_layers() returning layers that do it")
