"""What a rank holds, described strategy-independently: named pieces of global tensors.

A *piece* is the flat element range [lo, hi) of one global tensor (flattened row-major) and the local tensor that
holds it. Every strategy maps onto this: DDP and plain modules hold [0, numel) of every parameter; ZeRO / FSDP hold
the slice of each parameter that intersects their shard. Optimizer state that has the parameter's shape (Adam's
exp_avg, exp_avg_sq) follows the parameter's piece; other state (the step count) is a whole, replicated tensor.

Names: "param/<name>", "buffer/<name>", "optim/<param name>/<state key>". Parameter names are those of
`named_parameters()` (a tied parameter appears once, under its first name), so they match across strategies.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

__all__ = ["Piece", "local_pieces", "param_targets"]


@dataclasses.dataclass
class Piece:
    name: str
    shape: list[int]  # of the global tensor
    dtype: str
    lo: int
    hi: int
    tensor: torch.Tensor  # local, 1-D view of [lo, hi) (or the whole tensor for replicated state)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "shape": self.shape, "dtype": self.dtype, "lo": self.lo, "hi": self.hi,
                "nbytes": (self.hi - self.lo) * self.tensor.element_size()}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def param_targets(model: nn.Module) -> dict[str, tuple[nn.Parameter, list[int], int, int]]:
    """name -> (local parameter, global shape, lo, hi) for every parameter this rank holds a piece of."""
    engine = getattr(model, "_sharding", None)
    targets: dict[str, tuple[nn.Parameter, list[int], int, int]] = {}
    if engine is not None:
        owner = {id(info.shard_param): info for unit in engine.units for info in unit.infos}
        for name, p in model.named_parameters():
            info = owner[id(p)]
            targets[name] = (p, list(info.shape), info.shard_lo, info.shard_hi)
        return targets
    tp_layout = getattr(model, "_tensor_parallel_layout", None)
    if tp_layout is not None:
        raise NotImplementedError("sharded checkpoints of tensor-parallel models need box slices; use export_full")
    for name, p in model.named_parameters():
        targets[name] = (p, list(p.shape), 0, p.numel())
    return targets


def local_pieces(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[Piece]:
    """Every piece of parameters, persistent buffers and optimizer state this rank holds (empty ones skipped)."""
    pieces: list[Piece] = []
    targets = param_targets(model)
    for name, (p, shape, lo, hi) in targets.items():
        if hi > lo:
            pieces.append(Piece(f"param/{name}", shape, dtype_name(p.dtype), lo, hi, p.detach().reshape(-1)))
    for prefix, module in model.named_modules():
        for bname, b in module._buffers.items():
            if b is not None and bname not in module._non_persistent_buffers_set:
                full = f"{prefix}.{bname}" if prefix else bname
                pieces.append(Piece(f"buffer/{full}", list(b.shape), dtype_name(b.dtype), 0, b.numel(), b.reshape(-1)))
    if optimizer is not None:
        names = {id(p): n for n, (p, _, _, _) in targets.items()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p, {})
                name = names.get(id(p))
                if name is None:
                    raise ValueError("the optimizer holds a parameter that is not in the model; build it after wrapping")
                _, shape, lo, hi = targets[name]
                for key, value in state.items():
                    if not isinstance(value, torch.Tensor):
                        continue  # plain numbers are saved in the metadata (see save.py)
                    piece_name = f"optim/{name}/{key}"
                    if value.shape == p.shape:  # follows the parameter's sharding
                        if hi > lo:
                            pieces.append(Piece(piece_name, shape, dtype_name(value.dtype), lo, hi,
                                                value.detach().reshape(-1)))
                    else:
                        pieces.append(Piece(piece_name, list(value.shape), dtype_name(value.dtype), 0, value.numel(),
                                            value.detach().reshape(-1)))
    return pieces
