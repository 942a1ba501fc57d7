"""A pipeline rank's gradients say that they are part of a larger model, so torch's clip and GradScaler refuse them.

Why. Under a pipeline each rank holds some of the layers. A plain loop's `torch.nn.utils.clip_grad_norm_(
model.parameters(), 1.0)` would then clip every rank by the norm of its own layers' gradients (each rank a different
coefficient, one process's never), and `torch.amp.GradScaler` would let each rank decide alone whether to skip the
step: wrong numbers with no error. After each step the gradients of this rank's stages become `ShardedTensor`s
(sharded_tensor.py) that are whole (`ShardSpec.whole`): everything runs on them as on plain tensors (the
optimizer's step, a per-parameter norm for a log, comparisons) except what torch's clip and GradScaler run to
combine all gradients into one figure (`torch._foreach_norm`, `torch.linalg.vector_norm`, the scaler's finiteness
check), which raises naming `sw.clip_grad_norm_` and `sw.ShardedGradScaler`, which reduce over the pipeline.
The parameters themselves stay plain: the user's layers compute with them, and a subclass there would refuse their
matmuls. A pipeline that holds every stage on one rank has the whole model's gradients and is left alone.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from ..sharded_tensor import ShardSpec, as_sharded, is_sharded

__all__ = ["grads_answer_for_stages"]


def grads_answer_for_stages(params: Iterable[tuple[str, nn.Parameter]], n_ranks: int,
                            specs: dict[int, ShardSpec]) -> None:
    """Re-describe each plain gradient of `params` (name, parameter) as part of a pipeline over `n_ranks` ranks.
    `specs` caches each parameter's description across steps (by id). No copy; idempotent."""
    for name, p in params:
        grad = p.grad
        if grad is None or is_sharded(grad):
            continue  # none, already described, or a tensor-parallel / ZeRO piece's (which says more)
        spec = specs.get(id(p))
        if spec is None:
            spec = specs[id(p)] = ShardSpec(p.shape, f"{name}.grad", f"a pipeline over {n_ranks} ranks (this rank "
                                                                   f"holds some of the layers)", whole=True)
        p.grad = as_sharded(grad, spec)
