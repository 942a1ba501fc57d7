"""`load_checkpoint`: a transaction over the model's ranks (validate, stage, agree, commit), strict by default.

A checkpoint saved by N ranks under one layout loads on M ranks under another: each rank reads, for each box it
holds, only the saved slices intersecting it (reader.py). The load runs in four steps:

1. Validate, on every rank, with no communication: the paths (every symlink must stay inside the checkpoint root),
   the metadata (validate.py: keys, dtypes, shapes bounded by the files' sizes), and the fit between the checkpoint
   and what this rank holds: every parameter and buffer present with the model's shape and dtype, an optimizer of
   the saved type with the saved parameter groups, this rank's RNG entry well formed.
2. Stage: read every box this rank holds into staging tensors: a host (CPU) copy for each tensor that exists in
   the model or optimizer, and a fresh tensor on the parameter's device for optimizer state that does not exist
   yet (the optimizer sees it only at step 4). Each file's size and sha256 are checked when it is first opened,
   each stored tensor's shape and dtype when it is read, and every element of every held box must be found.
3. Agree: one all_gather of a small JSON record over the model's communicator: each rank's error (or none) and the
   checkpoint tensors nobody consumed, so that a pipeline stage does not call the other stages' tensors unexpected.
4. Commit, only if every rank succeeded and (strict) nothing was unexpected: copy the staged tensors into place,
   set the optimizer's hyperparameters, install its state, hand each declared strategy state its checked dict
   (strategy_state.py), restore the RNG states: in-memory copies only.
A failure before step 4 on any rank leaves every rank's model and optimizer untouched; the failing rank raises its
own error, the others a CheckpointError naming it.

Memory: staging holds a host copy of the tensors this rank already has (its parameters, buffers and, when the
optimizer has stepped, its optimizer state): at most this rank's share of the checkpoint, the bytes a save's
snapshot takes, freed when the load returns. Optimizer state the optimizer does not have yet is read straight into
its own device tensors. Nothing here unpickles anything.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import torch
from torch import nn

from .. import layout
from ..dropout_stream import check_positions
from ..sharded_tensor import local
from ..comm.base import Communicator
from ..comm.objects import all_gather_json
from .optim_load import stage_optimizer
from .reader import Reader, fill_held
from .save import model_comm, strategy_name
from .staged import Staged
from .storage import METADATA, CheckpointError, CheckpointMismatch, resolve_checkpoint
from .strategy_state import PREFIX, declared_states, stage_strategy_state
from .validate import read_metadata, rng_states, tensor_dtype

__all__ = ["load_checkpoint", "read_metadata", "read_tensors"]

log = logging.getLogger("shardwise.checkpoint")
_LISTED = 10  # problems named in one error message


def _stage(staged: Staged, path: str | os.PathLike, comm: Communicator, verify: bool, restore_rng: bool,
           stack: contextlib.ExitStack, reset_strategy_state: bool = False) -> None:
    """Step 2 (and the fit checks of step 1): read every box this rank holds into `staged`'s copies."""
    root, staged.directory = resolve_checkpoint(path)
    staged.metadata = read_metadata(staged.directory, root)
    reader = Reader(root, staged.directory, staged.metadata, verify, stack)
    for pl in layout.placements(staged.model).values():
        what = f"parameter {pl.name!r}"
        entry = staged.match(f"param/{pl.name}", what, pl.shape, pl.param.dtype)
        if entry is not None:
            held = local(pl.param)  # this rank's piece (sharded_tensor.py)
            copy = torch.empty(held.shape, dtype=held.dtype)
            fill_held(reader, entry, what, pl, copy)
            staged.copies.append((held, copy))
    for name, b in layout.buffers(staged.model).items():
        entry = staged.match(f"buffer/{name}", f"buffer {name!r}", tuple(b.shape), b.dtype)
        if entry is not None:
            copy = torch.empty(b.shape, dtype=b.dtype)
            reader.fill(entry, f"buffer {name!r}", copy, layout.full_box(b.shape))
            staged.copies.append((b, copy))
    if staged.optimizer is not None:
        stage_optimizer(staged, reader)
    stage_strategy_state(staged, reader, comm, strategy_name(staged.model), reset_strategy_state)
    rng = staged.metadata.get("rng", {})
    if restore_rng and staged.metadata["world_size"] == comm.size and str(comm.rank) in rng:
        _stage_rng(staged, reader, rng[str(comm.rank)], comm.rank)


def _stage_rng(staged: Staged, reader: Reader, saved: Any, rank: int) -> None:
    where = str(staged.directory / METADATA)
    python, numpy_state, keys, file = rng_states(saved, where, rank)
    states: dict[str, torch.Tensor] = {}
    for name, key in keys.items():
        state = reader.tensor(file, key).clone()
        index = name.removeprefix("rng/cuda")
        try:
            if name == "rng/torch":
                torch.Generator().set_state(state)  # a fresh generator: checks without applying
            elif not (name.startswith("rng/cuda") and index.isdigit() and state.dtype == torch.uint8):
                raise ValueError(f"unknown generator {name!r} or state of dtype {state.dtype}")
        except (RuntimeError, ValueError, TypeError) as exc:
            raise CheckpointError(f"{where}: the RNG entry of rank {rank} is malformed ({exc})") from None
        states[name] = state
    try:
        positions = check_positions(saved["json"].get("dropout"))
    except ValueError as exc:
        raise CheckpointError(f"{where}: the RNG entry of rank {rank} is malformed ({exc})") from None
    staged.rng = (python, numpy_state, states, positions)


def _unexpected_here(staged: Staged, partitioned: bool) -> dict[str, Any]:
    """This rank's part of the agreement record: the checkpoint tensors it did not consume, or (pipeline stages,
    which each consume a part) the ones it did, the shorter list."""
    states = {"states": sorted(declared_states(staged.model, staged.optimizer))}
    if partitioned:
        return {"consumed": sorted(staged.consumed), "optim": staged.optim_checked, **states}
    return {"unexpected": sorted(_unconsumed(staged, staged.consumed, staged.optim_checked)), **states}


def _unconsumed(staged: Staged, consumed: set[str], optim: bool) -> set[str]:
    return {n for n in staged.metadata["tensors"] if n not in consumed and (optim or not n.startswith("optim/"))}


def _unexpected(staged: Staged, records: list[dict[str, Any]], reset_strategy_state: bool = False) -> list[str]:
    """Checkpoint tensors that no rank consumed, and strategy states no rank declares (the same list on every
    rank); with reset_strategy_state, saved per-rank states are ignored."""
    sets = [set(r["unexpected"]) if "unexpected" in r else _unconsumed(staged, set(r["consumed"]), r["optim"])
            for r in records]
    declared = set().union(*(r["states"] for r in records))
    saved = {n for n, s in staged.metadata.get("strategy_state", {}).items()
             if not (reset_strategy_state and s["scope"] == "per_rank")}
    return sorted(set.intersection(*sets)) + [f"{PREFIX}{n}" for n in sorted(saved - declared)]


def _listing(problems: list[str]) -> str:
    more = len(problems) - _LISTED
    return "; ".join(problems[:_LISTED]) + (f"; and {more} more" if more > 0 else "")


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    comm: Communicator | None = None,
    strict: bool = True,
    verify: bool = True,
    restore_rng: bool = True,
    reset_strategy_state: bool = False,
) -> dict[str, Any]:
    """Load the checkpoint at `path` (a checkpoint directory, or a root whose `latest` names one) into `model` and
    `optimizer`, whatever strategies, layout and world size saved it; collective over the model's ranks (`comm`).
    Returns the saved extras plus "step" (and "skipped" with strict=False).

    strict: every parameter and buffer must be in the checkpoint with the model's shape and dtype, every tensor of
        the checkpoint must belong to the model (optimizer state: to a parameter the optimizer holds), and the
        optimizer must be of the saved type with the saved parameter groups; else CheckpointMismatch (a ValueError)
        naming them, and nothing is loaded. strict=False loads what fits and returns the rest under "skipped"
        ({name: reason}; "optimizer" when the optimizer's type differs: then none of its state is loaded), also
        logged as a warning.
    verify: check every file read against its sha256. restore_rng: restore this rank's torch / Python / NumPy
        RNG states when the world size is the one that saved (on another world size they do not map, and are left).
    Strategy state (`layout.ExtraState`: a compressor's per-rank residuals, local SGD's anchors) is loaded with the
    rest: replicated state on any world size, per-rank state only onto the saving world size and layout, under
    the saved configuration. reset_strategy_state: start every per-rank state fresh instead (and ignore the saved
    one): the way to resume compressed training on another world size.
    Transactional: nothing changes on any rank unless every rank validated and read everything it needs.
    """
    comm = model_comm(model, comm)
    staged = Staged(model, optimizer)
    error: Exception | None = None
    partitioned = layout.is_partitioned(model)
    with contextlib.ExitStack() as stack:
        try:
            if not isinstance(reset_strategy_state, bool):
                raise ValueError(f"load_checkpoint: reset_strategy_state={reset_strategy_state!r} must be True or "
                                 f"False")
            _stage(staged, path, comm, verify, restore_rng, stack, reset_strategy_state)
            if strict and staged.problems:
                raise CheckpointMismatch(f"load_checkpoint: {staged.directory} does not fit (strict=True; strict=False "
                                         f"loads what fits): {_listing(list(staged.problems.values()))}")
        except Exception as exc:  # noqa: BLE001 - re-raised below, once every rank knows
            error = exc
    record: dict[str, Any] = {"error": None if error is None else f"{type(error).__name__}: {error}"[:2000]}
    if error is None:
        record.update(_unexpected_here(staged, partitioned))
    records = all_gather_json(comm, record)
    if error is not None:
        raise error
    failed = [r for r, rec in enumerate(records) if rec["error"] is not None]
    if failed:
        raise CheckpointError(f"load_checkpoint: rank {failed[0]} failed to load {staged.directory}: "
                              f"{records[failed[0]]['error']} (ranks that failed: {failed}); nothing was loaded on "
                              f"rank {comm.rank}")
    unexpected = _unexpected(staged, records, reset_strategy_state)
    if unexpected and strict:
        raise CheckpointMismatch(f"load_checkpoint: {staged.directory} holds tensors (or strategy state) that the model (or its "
                                 f"optimizer) does not have (strict=True; strict=False ignores them): "
                                 f"{_listing(unexpected)}")
    staged.commit()
    extra = dict(staged.metadata.get("extra", {}), step=staged.metadata["step"])
    if not strict:
        skipped = dict(staged.problems, **{name: "not held by the model's optimizer" if name.startswith("optim/")
                                          else "no strategy of the model declares it" if name.startswith(PREFIX)
                                          else "not in the model" for name in unexpected})
        if skipped:
            log.warning("load_checkpoint: %s: skipped %d: %s", staged.directory, len(skipped),
                        _listing([f"{k}: {v}" for k, v in skipped.items()]))
        extra["skipped"] = skipped
    return extra


def read_tensors(path: str | os.PathLike, *, verify: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded checkpoint, whole ("param/<name>", "optim/<name>/<key>", "buffer/<name>"): for
    inspecting or converting checkpoints without building the model. Reads everything into memory."""
    root, directory = resolve_checkpoint(path)
    metadata = read_metadata(directory, root)
    out: dict[str, torch.Tensor] = {}
    with contextlib.ExitStack() as stack:
        reader = Reader(root, directory, metadata, verify, stack)
        for name, entry in metadata["tensors"].items():
            value = torch.empty(entry["shape"], dtype=tensor_dtype(entry["dtype"], name))
            reader.fill(entry, name, value, layout.full_box(value.shape))
            out[name] = value
    return out
