"""Strategy state in checkpoints: what strategies (and optimizers) declare as `layout.ExtraState`, saved and loaded
with the model.

Some state lives beside the parameters and the optimizer: a gradient compressor's error-feedback residuals, one per
bucket *on each rank*, and PowerSGD's Q (Vogels et al. 2019; without them a resumed run is not the run it resumes);
local SGD's anchors and outer optimizer (Douillard et al., DiLoCo), equal on every rank; 1-bit Adam's step count.
Strategies declare it through the layout contract (`Parallelized.extra_state`); an optimizer that carries state
beyond torch's per-parameter state offers `optimizer.extra_state()`. The checkpoint never reads their attributes.

Save: every rank snapshots its declared states (host copies, taken before the save returns, so an async save is
consistent). A "per_rank" state is written by every rank into its own shard file; a "replicated" one once, by the
lowest rank declaring it. Tensors go into the shard file as `strategy/<name>/<key>@<rank>`; plain values into the
metadata, which records under "strategy_state" each state's scope, the configuration it is valid under and, per
writing rank, its group size and rank and where each tensor is.

Load (inside the checkpoint's transaction, load.py): each rank finds its states' saved copy (a per-rank state:
the copy of the same rank, which exists only on the same world size and strategy layout; a replicated state: the
one copy, on any world size), reads and checks its tensors (file sha256, shape, dtype), and asks the declaring side
to `check` the dict, all before the ranks agree; `load_state_dict` is called only at commit. A per-rank state that
does not map (another world size or layout, another compressor configuration or bucket layout, none saved) is an
error naming it, unless `reset_strategy_state=True`: then every per-rank state starts fresh (`load_state_dict({})`)
and saved per-rank state is ignored. Residuals are an optimisation memory, so resetting them is legitimate: the
first steps after the resume send what those steps compute, and nothing accumulated before is replayed.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from .. import layout
from ..comm.base import Communicator
from .pieces import dtype_name
from .reader import Reader
from .staged import Staged
from .storage import CheckpointError
from .validate import tensor_dtype

__all__ = ["declared_states", "save_problems", "snapshot", "merge_indexes", "stage_strategy_state", "PREFIX"]

PREFIX = "strategy/"  # the metadata and agreement name of a state: "strategy/<name>"
RESET_HINT = ("pass reset_strategy_state=True to start it fresh (residuals are an optimisation memory: "
              "docs/checkpoints.md, 'Strategy state')")


def declared_states(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, layout.ExtraState]:
    """The model's strategies' extra states and the optimizer's (`optimizer.extra_state()`), by name."""
    states = layout.extra_states(model)
    offered = getattr(optimizer, "extra_state", None) if optimizer is not None else None
    if callable(offered):
        for state in offered():
            if not isinstance(state, layout.ExtraState):
                raise ValueError(f"checkpoint: {type(optimizer).__name__}.extra_state() must return "
                                 f"shardwise.layout.ExtraState records, got {type(state).__name__}")
            if state.name in states:
                raise ValueError(f"checkpoint: the optimizer's extra state {state.name!r} has the name of a "
                                 f"strategy's; names must be unique")
            states[state.name] = state
    return states


def save_problems(states: dict[str, layout.ExtraState], comm: Communicator) -> list[str]:
    """Why these states cannot be saved over `comm` (a state over ranks the checkpoint does not span), or []."""
    out = []
    ranks = set(comm.global_ranks)
    for name, state in states.items():
        if state.group is not None and not set(state.group.global_ranks) <= ranks:
            out.append(f"strategy state {name!r} belongs to ranks {sorted(state.group.global_ranks)} but the "
                       f"checkpoint's communicator spans {sorted(ranks)}: pass comm= spanning every rank of the model")
        try:
            json.dumps(state.config)
        except (TypeError, ValueError) as exc:
            out.append(f"strategy state {name!r}: config is not JSON-serialisable ({exc})")
    return out


def _group_position(state: layout.ExtraState) -> tuple[int | None, int | None]:
    return (None, None) if state.group is None else (state.group.size, state.group.rank)


def snapshot(states: dict[str, layout.ExtraState], writes: set[str], rank: int, file: str
             ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's states named in `writes`: (tensors for its shard file, their index entry). Host copies, now."""
    tensors: dict[str, torch.Tensor] = {}
    entries: dict[str, Any] = {}
    for name in sorted(writes):
        state = states[name]
        data = state.state_dict()
        if not isinstance(data, dict):
            raise ValueError(f"save_checkpoint: strategy state {name!r}: state_dict() returned "
                             f"{type(data).__name__}, not a dict")
        described: dict[str, Any] = {}
        values: dict[str, Any] = {}
        for key, value in data.items():
            if not isinstance(key, str):
                raise ValueError(f"save_checkpoint: strategy state {name!r}: key {key!r} is not a str")
            if isinstance(value, torch.Tensor):
                stored = f"{PREFIX}{name}/{key}@{rank}"
                tensors[stored] = value.detach().to("cpu", copy=True).contiguous()
                described[key] = {"key": stored, "shape": list(value.shape), "dtype": dtype_name(value.dtype)}
            else:
                try:
                    json.dumps(value)
                except (TypeError, ValueError):
                    raise ValueError(f"save_checkpoint: strategy state {name!r}: entry {key!r} is neither a tensor "
                                     f"nor JSON-serialisable ({type(value).__name__})") from None
                values[key] = value
        size, position = _group_position(state)
        entries[name] = {"scope": state.scope, "config": state.config, "group_size": size, "group_rank": position,
                         "file": file, "tensors": described, "values": values}
    return tensors, entries


def merge_indexes(merged: dict[str, Any], rank: int, entries: dict[str, Any]) -> None:
    """Rank 0, building metadata.json: add one rank's index entries to the "strategy_state" section."""
    for name, entry in entries.items():
        target = merged.setdefault(name, {"scope": entry["scope"], "config": entry["config"], "copies": {}})
        target["copies"][str(rank)] = {k: entry[k] for k in ("file", "group_size", "group_rank", "tensors",
                                                             "values")}


def _config_difference(saved: Any, mine: dict[str, Any]) -> str:
    if not isinstance(saved, dict):
        return f"saved {saved!r}, the model's {mine!r}"
    keys = sorted(set(saved) | set(mine))
    return "; ".join(f"{k}: saved {saved.get(k)!r}, the model's {mine.get(k)!r}" for k in keys
                     if saved.get(k) != mine.get(k))


def stage_strategy_state(staged: Staged, reader: Reader, comm: Communicator, strategy: str, reset: bool) -> None:
    """Find, read and check this rank's declared states (see the module docstring); problems go to `staged`."""
    saved_all = staged.metadata.get("strategy_state", {})
    states = declared_states(staged.model, staged.optimizer)
    problems = save_problems(states, comm)
    if problems:  # a load over a communicator the state does not live in (local SGD without comm=)
        raise ValueError(f"load_checkpoint: {'; '.join(problems)}")
    for name, state in states.items():
        what = f"{PREFIX}{name}"
        if state.scope == "per_rank" and reset:
            staged.strategy_loads.append((state, {}))
            continue
        saved = saved_all.get(name)
        hint = f"; {RESET_HINT}" if state.scope == "per_rank" else ""
        if saved is None:
            staged.problems[what] = f"strategy state {name!r} ({state.scope}) is not in the checkpoint{hint}"
            continue
        if saved["scope"] != state.scope:
            staged.problems[what] = (f"strategy state {name!r} is {state.scope} in the model but {saved['scope']} "
                                     f"in the checkpoint")
            continue
        if saved["config"] != state.config:
            staged.problems[what] = (f"strategy state {name!r} was saved under another configuration "
                                     f"({_config_difference(saved['config'], state.config)}){hint}")
            continue
        copy = _copy_for(staged, name, state, saved, comm, strategy)
        if copy is None:
            continue
        loaded = _read_copy(reader, name, copy)
        if state.check is not None:
            try:
                state.check(loaded)
            except (ValueError, TypeError) as exc:
                staged.problems[what] = f"strategy state {name!r} does not fit: {exc}"
                continue
        staged.strategy_loads.append((state, loaded))


def _copy_for(staged: Staged, name: str, state: layout.ExtraState, saved: dict[str, Any], comm: Communicator,
              strategy: str) -> dict[str, Any] | None:
    what = f"{PREFIX}{name}"
    copies = saved["copies"]
    if state.scope == "replicated":
        if len(copies) != 1:
            raise CheckpointError(f"{staged.directory}: replicated strategy state {name!r} has {len(copies)} saved "
                                  f"copies, expected one")
        return next(iter(copies.values()))
    world, saved_strategy = staged.metadata["world_size"], staged.metadata.get("strategy")
    if world != comm.size or saved_strategy != strategy:
        staged.problems[what] = (f"strategy state {name!r} is per rank: saved by {world} ranks under "
                                 f"{saved_strategy!r}, this load runs on {comm.size} ranks under {strategy!r}, and "
                                 f"each rank's state maps only onto the same rank of the same layout; "
                                 f"{RESET_HINT}")
        return None
    copy = copies.get(str(comm.rank))
    if copy is None:
        staged.problems[what] = f"strategy state {name!r} has no saved copy for rank {comm.rank}; {RESET_HINT}"
        return None
    if [copy["group_size"], copy["group_rank"]] != list(_group_position(state)):
        size, position = _group_position(state)
        staged.problems[what] = (f"strategy state {name!r} of rank {comm.rank} was saved as rank "
                                 f"{copy['group_rank']} of a group of {copy['group_size']}, this rank is rank "
                                 f"{position} of {size}; {RESET_HINT}")
        return None
    return copy


def _read_copy(reader: Reader, name: str, copy: dict[str, Any]) -> dict[str, Any]:
    """The saved dict: tensors read from the shard file (size, sha256, shape and dtype checked), values as saved."""
    out: dict[str, Any] = dict(copy["values"])
    for key, entry in copy["tensors"].items():
        value = reader.tensor(copy["file"], entry["key"])
        dtype = tensor_dtype(entry["dtype"], f"strategy state {name!r} entry {key!r}")
        if list(value.shape) != list(entry["shape"]) or value.dtype != dtype:
            raise CheckpointError(f"{reader.directory / copy['file']}: {entry['key']} is {tuple(value.shape)} "
                                  f"{dtype_name(value.dtype)}, the metadata says {tuple(entry['shape'])} "
                                  f"{entry['dtype']}")
        out[key] = value.clone()
    return out
