"""`load_checkpoint`: each rank reads, for each piece it holds, only the saved slices that intersect it.

A checkpoint saved by N ranks under one layout therefore loads on M ranks under another (DDP, ZeRO-1/2/3, FSDP,
tensor parallel, pipeline and their compositions): the metadata says which file holds which box of every tensor,
each rank intersects the boxes it holds (shardwise.layout) with the saved ones, and safetensors reads exactly the
intersection from disk. Loading needs no communication. Files are checked against their sha256 before use; a
missing, truncated or corrupt file, an unreadable metadata file, or a model whose shapes differ raise an error
naming the file or the parameter. Nothing here unpickles anything.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from torch import nn

from .. import layout
from ..comm.base import Communicator
from .pieces import optimizer_names
from .save import FORMAT, READABLE_VERSIONS, VERSION, model_comm
from .storage import METADATA, CheckpointError, check_file_name, resolve_checkpoint, sha256_of

__all__ = ["load_checkpoint", "read_metadata", "read_tensors"]


def read_metadata(directory: Path) -> dict[str, Any]:
    path = directory / METADATA
    try:
        metadata = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON (truncated or corrupt): {exc}") from None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a shardwise checkpoint")
    if metadata.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(f"{path} has format version {metadata.get('version')!r}; this shardwise writes "
                              f"{VERSION} and reads {list(READABLE_VERSIONS)}")
    for name in metadata.get("files", {}):
        check_file_name(name, path)
    return metadata


class _Reader:
    """Opens each shard file at most once, after checking its size and sha256 against the metadata."""

    def __init__(self, directory: Path, metadata: dict[str, Any], verify: bool, stack: contextlib.ExitStack) -> None:
        self.directory = directory
        self.files = metadata["files"]
        self.verify = verify
        self.stack = stack
        self.handles: dict[str, Any] = {}

    def handle(self, name: str) -> Any:
        if name not in self.handles:
            check_file_name(name, self.directory / METADATA)
            path = self.directory / name
            expected = self.files.get(name)
            if expected is None:
                raise CheckpointError(f"{self.directory / METADATA} refers to {name}, which it does not list")
            if not path.is_file():
                raise CheckpointError(f"{path} is missing")
            if path.stat().st_size != expected["bytes"]:
                raise CheckpointError(f"{path} has {path.stat().st_size} bytes, expected {expected['bytes']} "
                                      f"(truncated or replaced)")
            if self.verify and sha256_of(path) != expected["sha256"]:
                raise CheckpointError(f"{path} does not match its sha256 in the metadata (corrupt)")
            try:
                self.handles[name] = self.stack.enter_context(safe_open(str(path), framework="pt"))
            except Exception as exc:
                raise CheckpointError(f"{path} cannot be read as safetensors: {exc}") from None
        return self.handles[name]

    def _read(self, piece: dict[str, Any], saved: layout.Box, want: layout.Box) -> torch.Tensor:
        """The part `want` of a saved piece covering `saved`: a box-shaped stored tensor (format 2) is sliced on
        disk; a flat one (format 1: `offset` into a 1-D run of the global flattening) is read then reshaped."""
        handle = self.handle(piece["file"])
        key = piece["key"]
        if "offset" not in piece:
            if not saved:
                return handle.get_tensor(key)
            return handle.get_slice(key)[layout.box_slices(want, saved)]
        lo = piece["offset"]
        run = handle.get_slice(key)[lo : lo + layout.box_numel(saved)]
        return run.reshape([n for _, n in saved])[layout.box_slices(want, saved)]

    def fill(self, entry: dict[str, Any], what: str, dest: torch.Tensor, box: layout.Box) -> None:
        """Copy the global box `box` of the saved tensor into `dest` (shaped like the box), from the pieces that
        intersect it; every element must be found."""
        covered = 0
        for piece in _boxed_pieces(entry):
            saved = piece["box"]
            overlap = layout.intersect(saved, box) if box else ()
            if overlap is None:
                continue
            try:
                data = self._read(piece, saved, overlap)
            except CheckpointError:
                raise
            except Exception as exc:
                raise CheckpointError(f"{self.directory / piece['file']}: cannot read {piece['key']}: {exc}") from None
            with torch.no_grad():
                dest[layout.box_slices(overlap, box)].copy_(data)
            covered += layout.box_numel(overlap)
        if covered != layout.box_numel(box):
            raise CheckpointError(f"{self.directory}: {what} elements of box {list(box)} are not all in the checkpoint "
                                  f"({covered} of {layout.box_numel(box)} found)")


def _boxed_pieces(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """The entry's pieces as global boxes. Format 1 stored flat ranges [lo, hi) of the global flattening: each is
    cut into boxes, remembering where each box starts in the stored 1-D run."""
    if "boxed" not in entry:
        boxed = []
        for piece in entry["pieces"]:
            if "box" in piece:
                boxed.append(dict(piece, box=tuple(tuple(b) for b in piece["box"])))
                continue
            offset = 0
            for box in layout.split_flat_range(layout.full_box(entry["shape"]), piece["lo"], piece["hi"]):
                boxed.append(dict(piece, box=box, offset=offset))
                offset += layout.box_numel(box)
        entry["boxed"] = boxed
    return entry["boxed"]


def _fill_held(reader: _Reader, entry: dict[str, Any], what: str, pl: layout.Placement, target: torch.Tensor) -> None:
    """Fill every box `pl` holds of `target` (a tensor shaped like pl.param) from the checkpoint."""
    for box, view in layout.held_views(pl, target.detach()):
        reader.fill(entry, what, view, box)


def read_tensors(path: str | os.PathLike, *, verify: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded checkpoint, whole ("param/<name>", "optim/<name>/<key>", "buffer/<name>"): for
    inspecting or converting checkpoints without building the model. Reads everything into memory."""
    directory = resolve_checkpoint(path)
    metadata = read_metadata(directory)
    out: dict[str, torch.Tensor] = {}
    with contextlib.ExitStack() as stack:
        reader = _Reader(directory, metadata, verify, stack)
        for name, entry in metadata["tensors"].items():
            value = torch.empty(entry["shape"], dtype=getattr(torch, entry["dtype"]))
            reader.fill(entry, name, value, layout.full_box(value.shape))
            out[name] = value
    return out


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    comm: Communicator | None = None,
    verify: bool = True,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Load the checkpoint at `path` (a checkpoint directory, or a root whose `latest` names one) into `model` and
    `optimizer`, whatever strategies, layout and world size saved it. Returns the saved extras plus "step".

    verify: check every file read against its sha256. restore_rng: restore this rank's torch / Python / NumPy
    RNG states when the world size is the one that saved (on another world size they do not map, and are left).
    """
    directory = resolve_checkpoint(path)
    metadata = read_metadata(directory)
    tensors = metadata["tensors"]
    comm = model_comm(model, comm)
    with contextlib.ExitStack() as stack:
        reader = _Reader(directory, metadata, verify, stack)
        for pl in layout.placements(model).values():
            entry = tensors.get(f"param/{pl.name}")
            if entry is None:
                raise CheckpointError(f"{directory}: parameter {pl.name!r} is not in the checkpoint")
            if list(entry["shape"]) != list(pl.shape):
                raise ValueError(f"load_checkpoint: parameter {pl.name!r} has shape {tuple(pl.shape)} in the model but "
                                 f"{tuple(entry['shape'])} in {directory}")
            _fill_held(reader, entry, f"parameter {pl.name!r}", pl, pl.param)
        for name, b in layout.buffers(model).items():
            entry = tensors.get(f"buffer/{name}")
            if entry is None:
                raise CheckpointError(f"{directory}: buffer {name!r} is not in the checkpoint")
            if list(entry["shape"]) != list(b.shape):
                raise ValueError(f"load_checkpoint: buffer {name!r} has shape {tuple(b.shape)} in the model but "
                                 f"{tuple(entry['shape'])} in {directory}")
            reader.fill(entry, f"buffer {name!r}", b, layout.full_box(b.shape))
        if optimizer is not None:
            _load_optimizer(optimizer, model, metadata, reader, directory)
    if restore_rng and metadata["world_size"] == comm.size and str(comm.rank) in metadata["rng"]:
        _restore_rng(directory, metadata["rng"][str(comm.rank)], reader_files=metadata, verify=verify)
    return dict(metadata.get("extra", {}), step=metadata["step"])


def _load_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module, metadata: dict[str, Any],
                    reader: _Reader, directory: Path) -> None:
    owners = optimizer_names(model)
    saved_groups = metadata.get("param_groups", [])
    if saved_groups:
        # This rank holds part of the model (a pipeline stage): each of its groups must be part of the saved one.
        current = [[owners[id(p)].name if id(p) in owners else None for p in g["params"]]
                   for g in optimizer.param_groups]
        partial = any(r.partitioned_over is not None for r in layout.strategies(model))
        if len(current) != len(saved_groups) or any(
                not set(names) <= set(saved["params"]) if partial else set(names) != set(saved["params"])
                for names, saved in zip(current, saved_groups)):
            raise ValueError(f"load_checkpoint: the optimizer's parameter groups differ from those in {directory} "
                             f"(group sizes {[len(g) for g in current]} vs {[len(g['params']) for g in saved_groups]})")
        for group, saved in zip(optimizer.param_groups, saved_groups):
            for key, value in saved.items():
                if key != "params" and key in group and not isinstance(group[key], torch.Tensor):
                    group[key] = tuple(value) if isinstance(group[key], tuple) else value
    tensors = metadata["tensors"]
    scalars = metadata.get("optim_scalars", {})
    by_param: dict[str, list[str]] = {}
    for key in tensors:
        if key.startswith("optim/"):
            by_param.setdefault(key[len("optim/") : key.rindex("/")], []).append(key)
    for group in optimizer.param_groups:
        for p in group["params"]:
            pl = owners.get(id(p))
            if pl is None:
                raise ValueError("load_checkpoint: the optimizer holds a parameter that is not in the model")
            prefix = f"optim/{pl.name}/"
            existing = optimizer.state.get(p, {})
            state: dict[str, Any] = dict(scalars.get(pl.name, {}))
            for key in by_param.get(pl.name, ()):
                entry = tensors[key]
                dtype = getattr(torch, entry["dtype"])
                # Format 1 did not record it: state shaped like the parameter followed it.
                follows = entry.get("follows_param", list(entry["shape"]) == list(pl.shape) and entry["shape"] != [])
                local_shape = p.shape if follows else torch.Size(entry["shape"])
                device = p.device if follows else torch.device("cpu")
                old = existing.get(key[len(prefix):])
                # Refill the optimizer's own tensor when it fits (no allocation); every element gets written.
                if isinstance(old, torch.Tensor) and old.shape == local_shape and old.dtype == dtype:
                    value = old
                else:
                    value = torch.empty(local_shape, dtype=dtype, device=device)
                if follows:
                    _fill_held(reader, entry, key, pl, value)
                else:
                    reader.fill(entry, key, value, layout.full_box(value.shape))
                state[key[len(prefix):]] = value
            if state:
                optimizer.state[p] = state


def _restore_rng(directory: Path, saved: dict[str, Any], reader_files: dict[str, Any], verify: bool) -> None:
    with contextlib.ExitStack() as stack:
        reader = _Reader(directory, reader_files, verify, stack)
        handle = reader.handle(saved["file"])
        for name, key in saved["tensors"].items():
            state = handle.get_tensor(key)
            if name == "rng/torch":
                torch.set_rng_state(state)
            elif name.startswith("rng/cuda") and torch.cuda.is_available():
                index = int(name[len("rng/cuda"):])
                if index < torch.cuda.device_count():
                    torch.cuda.set_rng_state(state, index)
    version, internal, gauss = saved["json"]["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = saved["json"]["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
