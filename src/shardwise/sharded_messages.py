"""What a refused operation on a sharded piece should be instead (sharded_tensor.py's messages, by operation name)."""

from __future__ import annotations

from typing import Any

__all__ = ["CLIP", "MESSAGES", "PIECE", "PIECE_OPTIMIZERS", "broadcast_piece", "whole_with_piece"]

PIECE = ("read the whole tensor with sw.full_state_dict(model) (collective), clip with sw.clip_grad_norm_(model, "
         "max_norm), scale losses with sw.ShardedGradScaler(model); a loss term on a parameter (a regulariser) is "
         "computed where it is whole: in a forward hook of its module; a method of the model called instead of its "
         "forward (CLIP's encode_image, a VAE's encode) gathers its parameters when the wrapper is told of it: "
         "forward_methods=('encode_image', ...)")
PIECE_OPTIMIZERS = ("; elementwise operations (SGD, Adam, AdamW and the like) run on the piece as they are, while an "
                    "optimizer that needs whole tensors (per-tensor norms: LARS, LAMB; factored moments: Adafactor; "
                    "Muon; LBFGS, which flattens every gradient) cannot step pieces: train it with sw.DDP or "
                    "FSDP(sharding='no_shard')")
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


def whole_with_piece(name: str, spec: Any, held: int) -> str:
    return (f"{name}() combines a whole tensor of shape {tuple(spec.shape)} with {spec.name}, a {spec.what} piece "
            f"(this rank holds {held} of its {spec.numel} elements): a copy of the whole model updated from the "
            f"wrapped one (torch.optim.swa_utils.AveragedModel, an EMA) would mix one rank's piece into every element. "
            f"Keep the average as pieces: ema = [p.detach().clone() for p in model.parameters()], after each step "
            f"torch._foreach_lerp_(ema, [p.detach() for p in model.parameters()], 1 - decay), and evaluate with them "
            f"copied in (p.data.copy_(e)); or update the copy from sw.full_state_dict(model) (collective)")


def broadcast_piece(name: str, spec: Any, held: int, other: tuple) -> str:
    return (f"{name}() would broadcast {spec.name}, a {spec.what} piece (this rank holds {held} of its {spec.numel} "
            f"elements, shape {tuple(spec.shape)}), against a tensor of shape {tuple(other)}, as if the flat piece "
            f"were the parameter: it is read where its unit is not gathered, outside the forward of a module that "
            f"holds it (or after that forward). Read it inside the forward of the module that registers it (a "
            f"container such as ParameterList has no forward: its parent's forward reads it), or keep it whole on "
            f"every rank with replicated_params=(param,) (it is then all-reduced as under DDP)")
