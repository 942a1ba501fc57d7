"""What a refused operation on a sharded piece should be instead (sharded_tensor.py's messages, by operation name)."""

from __future__ import annotations

from typing import Any

__all__ = ["CLIP", "MESSAGES", "PIECE", "PIECE_OPTIMIZERS", "address_of_piece", "broadcast_piece", "data_set",
           "part_of_model", "pickling", "piece_only", "whole_with_piece"]

PIECE = ("read the whole tensor with sw.full_state_dict(model) (collective), clip with sw.clip_grad_norm_(model, "
         "max_norm), scale losses with sw.ShardedGradScaler(model); a loss term on a parameter (a regulariser) is "
         "computed where it is whole: in a forward hook of its module; a method of the model called instead of its "
         "forward (CLIP's encode_image, a VAE's encode) gathers its parameters when the wrapper is told of it: "
         "forward_methods=('encode_image', ...)")
PIECE_OPTIMIZERS = ("; elementwise operations (SGD, Adam, AdamW and the like) run on the piece as they are, and "
                    "torch.linalg.vector_norm of a piece is its whole tensor's (LARS, LAMB written with it), while an "
                    "optimizer that needs whole tensors otherwise (factored moments: Adafactor; Muon; LBFGS, which "
                    "flattens every gradient) cannot step pieces: train it with sw.DDP or FSDP(sharding='no_shard')")
CLIP = ("torch.nn.utils.clip_grad_norm_ takes the whole tensors' norms of pieces (orders p > 0 and inf, no dims), "
        "but not of a pipeline stage's tensors, whose total needs the other stages': use "
        "sw.clip_grad_norm_(model, max_norm), which returns one process's norm (any other norm: of "
        "sw.full_state_dict(model))")
NORM = ("p.norm() of a piece would be the norm of this rank's piece: torch.linalg.vector_norm(p) (and torch's "
        "clip_grad_norm_) take the whole tensor's norm (a collective: every rank together); norms along a dim need "
        "the whole tensor, sw.full_state_dict(model)")
WHOLE_INIT = ("an initialiser that reads the whole tensor (torch.nn.init.trunc_normal_'s rejection sampling, "
              "orthogonal_, eye_, dirac_, sparse_) cannot run on a piece: initialise before wrapping (the wrap keeps "
              "the model's values), or load values made in one process with model.load_state_dict(state_dict); "
              "normal_, uniform_, constant_, xavier_* and kaiming_* run on pieces and give one process's values")
INDEXING = ("an index selects from the whole tensor only on a piece whose place its strategy declared (a "
            "parameter, or its .data), with a plain index: there p[i] = v and in-place writes to p[i] "
            "(init.zeros_(p[i]), p[i].normal_()) reach this rank's elements; elsewhere build the whole tensor and "
            "copy it in (with torch.no_grad(): p.copy_(whole), which each rank cuts to its part); to read, "
            "sw.full_state_dict(model) (collective)")
MESSAGES = {
    "new_tensor": WHOLE_INIT, "new_empty": WHOLE_INIT, "eye": WHOLE_INIT, "__getitem__": INDEXING,
    "__setitem__": INDEXING,
    "_foreach_norm": CLIP, "linalg_vector_norm": CLIP, "norm": NORM, "vector_norm": CLIP,
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


def data_set(spec: Any) -> str:
    return (f"assigning {spec.name}.data replaces the storage of a {spec.what} piece, which would no longer be the "
            f"shard the engine gathers and the optimizer steps (training would leave the model as it is): write in "
            f"place instead (p.data.copy_(x), or under torch.no_grad() p.copy_(x)); to cast or move the model, do it "
            f"before wrapping")


def address_of_piece(spec: Any, held: int) -> str:
    return (f"data_ptr() of {spec.name}, a {spec.what} piece ({held} of its {spec.numel} elements, shape "
            f"{tuple(spec.shape)}): a reader of the whole shape from this address (e.g. "
            f"safetensors.torch.save_file(model.state_dict())) would copy past the piece; save "
            f"sw.full_state_dict(model) (collective) instead")


def pickling(spec: Any, held: int) -> str:
    return (f"pickling {spec.name}, a {spec.what} shard ({held} of {spec.numel} elements on this rank), would save one "
            f"rank's piece: save the model with sw.save_checkpoint(path, model, optimizer) (sharded, any layout "
            f"reloads) or sw.full_state_dict(model) (whole tensors, collective)")


def part_of_model(name: str, spec: Any, why: str) -> str:
    return f"{name}() on {spec.name}, under {spec.what}, would combine only this rank's part of the model: {why}"


def piece_only(name: str, spec: Any, held: int, why: str) -> str:
    return (f"{name}() on {spec.name}, a {spec.what} shard (this rank holds {held} of its {spec.numel} elements, shape "
            f"{tuple(spec.shape)}), would see only this rank's piece: {why}")
