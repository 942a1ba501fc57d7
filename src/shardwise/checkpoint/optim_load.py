"""Staging an optimizer's part of a load (see load.py): its type, its parameter groups' hyperparameters, its state.

Nothing here touches the optimizer: hyperparameters and state dicts are prepared for `Staged.commit`. The
optimizer's type must be the saved one (the metadata records the class name; checkpoints from before that record
skip the check): an SGD given an AdamW checkpoint would otherwise take Adam's lr and install Adam's state. Each
saved hyperparameter must be of the kind the group holds (a number for a number, a list of numbers for a tuple).
State shaped like its parameter (Adam's exp_avg) follows the parameter's pieces; other state (the step count) is a
whole tensor. State the optimizer already has is refilled in place at commit from a host copy; state it does not
have yet is read into a new tensor on the parameter's device.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import layout
from ..sharded_tensor import local
from ..whole.optim_state import optimizer_names
from .reader import Reader, fill_held
from .staged import Staged
from .validate import tensor_dtype

__all__ = ["stage_optimizer"]


def _same_kind(current: Any, saved: Any) -> bool:
    """Whether a saved hyperparameter may replace the current one (None on either side: a default, replaceable)."""
    if current is None or saved is None:
        return True
    if isinstance(current, bool) or isinstance(saved, bool):
        return isinstance(current, bool) and isinstance(saved, bool)
    if isinstance(current, (int, float)):
        return isinstance(saved, (int, float))
    if isinstance(current, (tuple, list)):
        return isinstance(saved, list) and len(saved) == len(current) and all(map(_same_kind, current, saved))
    return type(current) is type(saved)


def stage_optimizer(staged: Staged, reader: Reader) -> None:
    optimizer, model, metadata = staged.optimizer, staged.model, staged.metadata
    assert optimizer is not None
    owners = optimizer_names(model)
    if any(id(p) not in owners for g in optimizer.param_groups for p in g["params"]):
        raise ValueError("load_checkpoint: the optimizer holds a parameter that is not in the model; build it after "
                         "wrapping, over model.parameters()")
    mine = type(optimizer).__name__
    if "optimizer" in metadata and metadata["optimizer"] != mine:
        saved = metadata["optimizer"]
        staged.problems["optimizer"] = (
            f"the checkpoint was saved without an optimizer, but a {mine} was given" if saved is None
            else f"the checkpoint's optimizer is {saved}, this one is {mine}")
        staged.optim_checked = False  # its tensors are reported once, as the optimizer's, not as unexpected
        return
    _stage_groups(staged, owners)
    _stage_state(staged, reader, owners)


def _stage_groups(staged: Staged, owners: dict[int, layout.Placement]) -> None:
    optimizer = staged.optimizer
    saved_groups = staged.metadata.get("param_groups", [])
    if not saved_groups:
        return
    # This rank holds part of the model (a pipeline stage): each of its groups must be part of the saved one.
    current = [[owners[id(p)].name for p in g["params"]] for g in optimizer.param_groups]
    partial = layout.is_partitioned(staged.model)
    if len(current) != len(saved_groups) or any(
            not isinstance(saved, dict) or not isinstance(saved.get("params"), list)
            or (not set(names) <= set(saved["params"]) if partial else set(names) != set(saved["params"]))
            for names, saved in zip(current, saved_groups)):
        staged.problems["param_groups"] = (
            f"the optimizer's parameter groups differ from those in the checkpoint (group sizes "
            f"{[len(g) for g in current]} vs {[len(g['params']) if isinstance(g, dict) else g for g in saved_groups]})")
        return
    values_by_group = []
    for i, (group, saved) in enumerate(zip(optimizer.param_groups, saved_groups)):
        values = {}
        for key, value in saved.items():
            if key == "params" or key not in group or isinstance(group[key], torch.Tensor):
                continue
            if not _same_kind(group[key], value):
                staged.problems[f"param_groups[{i}].{key}"] = (f"optimizer group {i}: {key}={value!r} in the "
                                                               f"checkpoint does not fit {group[key]!r}")
                continue
            values[key] = tuple(value) if isinstance(group[key], tuple) else value
        values_by_group.append(values)
    staged.group_values = values_by_group


def _stage_state(staged: Staged, reader: Reader, owners: dict[int, layout.Placement]) -> None:
    tensors = staged.metadata["tensors"]
    scalars = staged.metadata.get("optim_scalars", {})
    by_param: dict[str, list[str]] = {}
    for key in tensors:
        if key.startswith("optim/") and "/" in key[len("optim/"):]:
            by_param.setdefault(key[len("optim/") : key.rindex("/")], []).append(key)
    for group in staged.optimizer.param_groups:
        for p in group["params"]:
            pl = owners[id(p)]
            existing = staged.optimizer.state.get(p, {})
            state: dict[str, Any] = {}
            plain = scalars.get(pl.name, {})
            for key, value in (plain.items() if isinstance(plain, dict) else ()):
                if isinstance(value, (int, float)):  # bools are ints: the flags some optimizers keep
                    state[key] = value
                else:
                    staged.problems[f"optim/{pl.name}/{key}"] = (f"optimizer state {pl.name!r}.{key} is {value!r} in "
                                                                 f"the checkpoint, not a number")
            for key in by_param.get(pl.name, ()):
                staged.consumed.add(key)
                value = _stage_one(staged, reader, key, pl, p, existing.get(key.rsplit("/", 1)[1]))
                if value is not None:
                    state[key.rsplit("/", 1)[1]] = value
            if state:
                staged.optim_state.append((p, state))


def _stage_one(staged: Staged, reader: Reader, key: str, pl: layout.Placement, p: torch.Tensor,
               old: Any) -> torch.Tensor | None:
    """The tensor to install as optimizer state `key` of `p` (the optimizer's own `old` one when it fits: refilled
    at commit), or None with a problem recorded."""
    entry = staged.metadata["tensors"][key]
    dtype = tensor_dtype(entry["dtype"], key)
    # Format 1 did not record it: state shaped like the parameter followed it.
    follows = entry.get("follows_param", list(entry["shape"]) == list(pl.shape) and entry["shape"] != [])
    if follows and list(entry["shape"]) != list(pl.shape):
        staged.problems[key] = (f"optimizer state {key!r} has shape {tuple(entry['shape'])} in the checkpoint but "
                                f"its parameter has {tuple(pl.shape)}")
        return None
    old = local(old)  # pieces of a sharded parameter's state are this rank's (sharded_tensor.py)
    local_shape = local(p).shape if follows else torch.Size(entry["shape"])
    if isinstance(old, torch.Tensor) and old.shape == local_shape:
        if old.dtype != dtype:
            staged.problems[key] = (f"optimizer state {key!r} is {str(old.dtype).removeprefix('torch.')} in the "
                                    f"optimizer but {entry['dtype']} in the checkpoint")
            return None
        target = torch.empty(local_shape, dtype=dtype)
        staged.copies.append((old, target))
        value = old
    else:
        target = value = torch.empty(local_shape, dtype=dtype, device=p.device if follows else torch.device("cpu"))
    if follows:
        fill_held(reader, entry, key, pl, target)
    else:
        reader.fill(entry, key, target, layout.full_box(target.shape))
    return value
