"""Full optimizer state dicts of a sharded model, in torch's own format, and loading them back into any layout.

Under ZeRO / FSDP (and tensor parallel) each rank's optimizer holds state for its pieces only: AdamW's `exp_avg` of
a ZeRO-3 parameter is this rank's flat slice. torch's `optimizer.state_dict()` would save those slices under the
parameters' indices, a checkpoint that looks whole and resumes into a size mismatch or, worse, into the wrong
elements. So:

* `full_optimizer_state_dict(model, optimizer)` (collective: every rank calls it) returns what a one-process
  optimizer over the unwrapped model would return from `state_dict()`: the same `{"state", "param_groups"}`
  structure and indices, every state tensor shaped like its parameter gathered to the full shape (on CPU), scalars
  (`step`) as they are. Save it from rank 0 with torch.save, as a plain script does.
* `load_full_optimizer_state_dict(model, optimizer, state)` (no communication) slices each full state tensor into
  the piece this rank holds and loads the result with torch's `load_state_dict`; a full dict handed straight to
  `optimizer.load_state_dict` is converted the same way (optimizer_guard's load hook), so nanoGPT's resume works
  unchanged.
* `optimizer.state_dict()` itself, on an optimizer over sharded pieces, raises naming these (optimizer_guard);
  shardwise's own code reads the pieces inside `local_state_dict()`.

Indices follow torch's rule: the optimizer's parameters numbered in param-group order. They match a one-process
optimizer's when both were built over the parameters in the same order (the wrapped model yields its parameters in
the original model's order). Pipeline-partitioned models hold other stages' parameters elsewhere: use `sw.save`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .. import layout
from ..sharded_tensor import local
from .gather import iter_gathered, write_held

__all__ = ["follows_param", "full_optimizer_state_dict", "load_full_optimizer_state_dict", "local_state_dict",
           "localize_loaded_state", "optimizer_names", "reading_pieces", "to_local_optimizer_state"]

_raw = threading.local()


@contextlib.contextmanager
def local_state_dict() -> Iterator[None]:
    """Inside: `optimizer.state_dict()` / `load_state_dict()` of a sharded model's optimizer act on this rank's
    pieces, as torch's do (for shardwise's own code: this module, the elastic snapshot); the optimizer guard's
    hooks stand aside."""
    previous = getattr(_raw, "on", False)
    _raw.on = True
    try:
        yield
    finally:
        _raw.on = previous


def reading_pieces() -> bool:
    """Whether this thread is inside `local_state_dict()`."""
    return getattr(_raw, "on", False)


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def optimizer_names(model: nn.Module) -> dict[int, layout.Placement]:
    """id(trained tensor) -> its placement, to name what an optimizer holds."""
    return {id(pl.param): pl for pl in layout.placements(model).values()}


def follows_param(value: Any, param: torch.Tensor) -> bool:
    """Optimizer state sharded like its parameter (exp_avg), as opposed to a replicated scalar (step): compared on
    this rank's pieces (a ZeRO piece answers for the whole tensor's shape; sharded_tensor.py)."""
    if not isinstance(value, torch.Tensor):
        return False
    value, param = local(value), local(param)
    return value.dim() > 0 and value.shape == param.shape


def _refuse_pipelines(model: nn.Module, who: str) -> None:
    """A pipeline stage's optimizer holds one stage's parameters: no rank here can gather the others'."""
    if layout.is_partitioned(model):
        raise ValueError(f"{who}: the model is split into pipeline stages, whose optimizers each hold one stage's "
                         f"parameters; save and load it with sw.save / sw.load (sharded checkpoints of any layout)")


def localize_loaded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Slice state that torch's `load_state_dict` put in full into this rank's pieces, in place (a full dict loaded
    before the optimizer guard watched this optimizer: before its first step). No communication. Every reader of
    the state calls it first: a full-size state would otherwise look like a piece on the rank whose piece is the
    whole tensor and like something else on the others, and their gathers would not pair."""
    params = _params(optimizer)
    loaded = {"state": {i: optimizer.state[p] for i, p in enumerate(params) if p in optimizer.state}}
    for i, entry in to_local_optimizer_state(model, optimizer, loaded)["state"].items():
        optimizer.state[params[i]].update(entry)


def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state dict as one process would have it (see the module docstring). Collective."""
    _refuse_pipelines(model, "full_optimizer_state_dict")
    owners = optimizer_names(model)
    localize_loaded_state(model, optimizer)
    params = _params(optimizer)
    with local_state_dict():
        packed = optimizer.state_dict()
    state: dict[int, dict[str, Any]] = {}
    sharded: list[tuple[int, str, layout.Placement, torch.Tensor]] = []  # gathered together below
    # Every rank walks the same parameters in the same order, so the gathers pair up; a parameter no rank has state
    # for (never stepped: no gradient anywhere) has none on every rank, as the used flags agree.
    for index, param in enumerate(params):
        pl = owners.get(id(param))
        entry = packed["state"].get(index)
        if entry is None:
            continue
        out = state[index] = {}
        for key, value in entry.items():
            if pl is not None and follows_param(value, param):
                out[key] = None  # keeps torch's key order; filled from the gather
                sharded.append((index, key, pl, value))
            else:
                out[key] = value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
    gathered = iter_gathered([(pl, value) for _, _, pl, value in sharded])
    for (index, key, _, _), full in zip(sharded, gathered):
        state[index][key] = full.detach().cpu().clone()
    return {"state": state, "param_groups": packed["param_groups"]}


def to_local_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                             state_dict: dict[str, Any]) -> dict[str, Any]:
    """`state_dict` with every full-shaped state tensor replaced by the piece this rank holds (tensors already shaped
    like the pieces pass through). No communication."""
    owners = optimizer_names(model)  # slicing is local: a pipeline stage slices the parameters it holds
    params = _params(optimizer)
    state = {}
    for index, entry in state_dict.get("state", {}).items():
        param = params[int(index)] if int(index) < len(params) else None
        pl = owners.get(id(param)) if param is not None else None
        out = {}
        for key, value in entry.items():
            if pl is not None and isinstance(value, torch.Tensor) and value.dim() > 0 and \
                    tuple(value.shape) == tuple(pl.shape) and not follows_param(value, param):
                piece = torch.empty_like(local(param), dtype=value.dtype)
                write_held(pl, piece, value.to(piece.device))
                out[key] = piece
            else:
                out[key] = value
        state[index] = out
    return {**state_dict, "state": state}


def load_full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer,
                                   state_dict: dict[str, Any]) -> None:
    """Load a full optimizer state dict (from `full_optimizer_state_dict`, or a one-process optimizer's
    `state_dict()`) into this rank's optimizer over the wrapped model's pieces. No communication."""
    converted = to_local_optimizer_state(model, optimizer, state_dict)
    with local_state_dict():
        optimizer.load_state_dict(converted)
