"""What a refused operation on a sharded piece should be instead (sharded_tensor.py's messages, by operation name)."""

from __future__ import annotations

__all__ = ["CLIP", "MESSAGES"]

CLIP = ("torch.nn.utils.clip_grad_norm_ over a sharded model would clip each rank by its own piece's norm: use "
         "sw.clip_grad_norm_(model, max_norm), which returns one process's norm (any other norm: of "
         "sw.full_state_dict(model))")
MESSAGES = {
    "_foreach_norm": CLIP, "linalg_vector_norm": CLIP, "norm": CLIP, "vector_norm": CLIP,
    "_amp_foreach_non_finite_check_and_unscale_": "torch.amp.GradScaler over a sharded model lets each rank decide "
                     "alone whether to skip the step: use sw.ShardedGradScaler(model) (the same API; every rank "
                     "skips together)",
    "grad": "torch.autograd.grad with respect to a parameter differentiates the piece, which the forward did not "
            "use (a unit computes with its gathered whole, freed after it): gradients of the parameters with "
            "create_graph=True (a gradient-norm penalty) work under sw.DDP, ZeRO-1/2 and wrap=None (one unit), "
            "averaged over the ranks; gradients of the inputs (a WGAN-GP or R1 penalty) work under every stage",
}
