"""Local SGD's state declared to whole-model tools (layout.py): a "local_sgd" record whose extra state is the outer
state (step counters, anchors, the outer optimizer's state), so `sw.save_checkpoint` / `sw.load_checkpoint` carry it.

A skipped inner step (a loss scaler found inf/nan) must not count: the record is a `StepBoundState` whose settle
tells `model.step()` so (`follows_steps`).

The outer state is equal on every rank after each synchronisation (anchors and outer optimizer are stepped with the
same averaged outer gradient everywhere), so it is declared "replicated": written once, reloadable on any world
size (DiLoCo's outer momentum stays meaningful with more or fewer workers). The record adds no communicator: local SGD
does not synchronise gradients, so clipping and overflow checks stay local to each worker, as they must. With
`compression=` the compressor's error-feedback memory is declared too, per rank (each rank's residual is its own).

The checkpoint's format is a flat {key: tensor or JSON value}; `outer_state_dict()`'s nested form maps onto it as
"inner_steps", "syncs", "anchor/<parameter name>", "outer/state/<index>/<key>" and "outer/param_groups", and back.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from .. import layout
from ..comm.base import Communicator
from ..whole.grad_scaler import StepBoundState
from .step_hook import mark_skipped

__all__ = ["declare_local_sgd", "flatten_outer", "follows_steps", "unflatten_outer"]


def follows_steps(record: layout.ExtraState, module: nn.Module) -> layout.ExtraState:
    """`record` as a StepBoundState whose settle marks a skipped step, so that `model.step()` after
    `sw.ShardedGradScaler(model).step(opt)` does not count it (step_hook.mark_skipped)."""
    def settle(taken: bool) -> None:
        if not taken:
            mark_skipped(module)

    return StepBoundState(**{f.name: getattr(record, f.name) for f in dataclasses.fields(record)}, settle=settle)


def flatten_outer(saved: dict[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {"inner_steps": saved["inner_steps"], "syncs": saved["syncs"]}
    flat.update({f"anchor/{name}": a for name, a in saved["anchors"].items()})
    outer = saved["outer_optimizer"]
    if outer is not None:
        flat["outer/param_groups"] = outer["param_groups"]
        for index, per_param in outer["state"].items():
            flat.update({f"outer/state/{index}/{key}": value for key, value in per_param.items()})
    return flat


def unflatten_outer(flat: dict[str, Any]) -> dict[str, Any]:
    """The nested form `load_outer_state_dict` takes; ValueError naming a key it cannot place."""
    saved: dict[str, Any] = {"anchors": {}, "outer_optimizer": None}
    state: dict[int, dict[str, Any]] = {}
    for key, value in flat.items():
        kind, _, rest = key.partition("/")
        if key in ("inner_steps", "syncs"):
            saved[key] = value
        elif kind == "anchor" and rest:
            saved["anchors"][rest] = value
        elif key == "outer/param_groups":
            saved["outer_optimizer"] = {"state": state, "param_groups": value}
        elif rest.startswith("state/") and kind == "outer" and rest.count("/") == 2 and rest.split("/")[1].isdigit():
            _, index, name = rest.split("/")
            state.setdefault(int(index), {})[name] = value
        else:
            raise ValueError(f"local SGD state: unknown entry {key!r} (allowed: inner_steps, syncs, anchor/<name>, "
                             f"outer/param_groups, outer/state/<index>/<key>)")
    if state and saved["outer_optimizer"] is None:
        raise ValueError("local SGD state: outer optimizer state without outer/param_groups")
    return saved


def _check(module: nn.Module, flat: dict[str, Any]) -> None:
    """ValueError unless `flat` fits this wrapper: counters, the same anchors (names, shapes, dtypes), an outer
    optimizer exactly when this one has one, with as many parameter groups and state only for its anchors."""
    saved = unflatten_outer(flat)
    mine = module.outer_state_dict()
    for key in ("inner_steps", "syncs"):
        if isinstance(saved.get(key), bool) or not isinstance(saved.get(key), int) or saved[key] < 0:
            raise ValueError(f"local SGD state: {key}={saved.get(key)!r} must be a non-negative int")
    if (saved["outer_optimizer"] is None) != (mine["outer_optimizer"] is None):
        raise ValueError(f"local SGD state: saved {'without' if saved['outer_optimizer'] is None else 'with'} an "
                         f"outer optimizer, but this LocalSGD has {'one' if mine['outer_optimizer'] else 'none'}")
    if sorted(saved["anchors"]) != sorted(mine["anchors"]):
        raise ValueError(f"local SGD state: the anchors ({len(saved['anchors'])}) are not the model's trainable "
                         f"parameters ({len(mine['anchors'])})")
    for name, anchor in saved["anchors"].items():
        like = mine["anchors"][name]
        if not isinstance(anchor, torch.Tensor) or anchor.shape != like.shape or anchor.dtype != like.dtype:
            raise ValueError(f"local SGD state: anchor {name!r} must be a {tuple(like.shape)} {like.dtype} tensor")
    outer = saved["outer_optimizer"]
    if outer is not None:
        groups = outer["param_groups"]
        if not isinstance(groups, list) or len(groups) != len(mine["outer_optimizer"]["param_groups"]):
            raise ValueError("local SGD state: the outer optimizer's parameter groups differ")
        if any(i >= len(mine["anchors"]) for i in outer["state"]):
            raise ValueError("local SGD state: outer optimizer state for a parameter index it does not have")


def declare_local_sgd(module: nn.Module, comm: Communicator, options: dict[str, Any]) -> None:
    """Declare `module`'s local SGD (just wrapped, so it has `outer_state_dict`) to the layout contract."""
    before = layout.placements(module)
    has_outer = module.outer_state_dict()["outer_optimizer"] is not None
    state = layout.ExtraState(
        "local_sgd", "replicated",
        state_dict=lambda: flatten_outer(module.outer_state_dict()),
        load_state_dict=lambda flat: module.load_outer_state_dict(unflatten_outer(flat)),
        check=lambda flat: _check(module, flat),
        config={"outer_optimizer": type(module.outer_optimizer).__name__ if has_outer else None},
        group=comm)
    extra = [follows_steps(state, module)]
    if module.compressor is not None:  # the outer gradients' error-feedback memory: each rank's own
        sizes = [sum(p.numel() for p in module.parameters() if p.requires_grad and p.dtype == dtype)
                 for dtype in dict.fromkeys(p.dtype for p in module.parameters() if p.requires_grad)]
        # Outer gradients are not loss-scaled and each synchronisation settles its own reduction.
        extra.append(module.compressor.extra_state(comm, follows_gradients=False, buckets=sizes))
    layout.declare(module, layout.Parallelized("local_sgd", (), before, options=options, extra_state=tuple(extra)))
