"""`load_checkpoint`: each rank reads, for each piece it holds, only the saved slices that intersect it.

A checkpoint saved by N ranks under one strategy therefore loads on M ranks under another (DDP, ZeRO-1/2/3, FSDP):
the metadata says which file holds which flat range of every tensor, and safetensors reads a slice of a tensor
without reading the rest. Loading needs no communication. Files are checked against their sha256 before use; a
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

from ..comm.base import Communicator
from .pieces import param_targets
from .save import FORMAT, VERSION, model_comm
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
    if metadata.get("version") != VERSION:
        raise CheckpointError(f"{path} has format version {metadata.get('version')!r}; this shardwise reads {VERSION}")
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

    def fill(self, entry: dict[str, Any], what: str, dest: torch.Tensor, lo: int, hi: int) -> None:
        """Copy the flat range [lo, hi) of the saved tensor into the 1-D `dest`, from the intersecting pieces."""
        covered = 0
        for piece in entry["pieces"]:
            a, b = max(lo, piece["lo"]), min(hi, piece["hi"])
            if a >= b:
                continue
            try:
                data = self.handle(piece["file"]).get_slice(piece["key"])[a - piece["lo"] : b - piece["lo"]]
            except CheckpointError:
                raise
            except Exception as exc:
                raise CheckpointError(f"{self.directory / piece['file']}: cannot read {piece['key']}: {exc}") from None
            with torch.no_grad():
                dest[a - lo : b - lo].copy_(data)
            covered += b - a
        if covered != hi - lo:
            raise CheckpointError(f"{self.directory}: {what} elements [{lo}, {hi}) are not all in the checkpoint "
                                  f"({covered} of {hi - lo} found)")


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
            reader.fill(entry, name, value.view(-1), 0, value.numel())
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
    `optimizer`, whatever strategy and world size saved it. Returns the saved extras plus "step".

    verify: check every file read against its sha256. restore_rng: restore this rank's torch / Python / NumPy
    RNG states when the world size is the one that saved (on another world size they do not map, and are left).
    """
    directory = resolve_checkpoint(path)
    metadata = read_metadata(directory)
    tensors = metadata["tensors"]
    comm = model_comm(model, comm)
    targets = param_targets(model)
    with contextlib.ExitStack() as stack:
        reader = _Reader(directory, metadata, verify, stack)
        for name, (p, shape, lo, hi) in targets.items():
            entry = tensors.get(f"param/{name}")
            if entry is None:
                raise CheckpointError(f"{directory}: parameter {name!r} is not in the checkpoint")
            if list(entry["shape"]) != list(shape):
                raise ValueError(f"load_checkpoint: parameter {name!r} has shape {tuple(shape)} in the model but "
                                 f"{tuple(entry['shape'])} in {directory}")
            if hi > lo:
                reader.fill(entry, f"parameter {name!r}", p.detach().view(-1), lo, hi)
        for prefix, module in model.named_modules():
            for bname, b in module._buffers.items():
                if b is None or bname in module._non_persistent_buffers_set:
                    continue
                full = f"{prefix}.{bname}" if prefix else bname
                entry = tensors.get(f"buffer/{full}")
                if entry is None:
                    raise CheckpointError(f"{directory}: buffer {full!r} is not in the checkpoint")
                if list(entry["shape"]) != list(b.shape):
                    raise ValueError(f"load_checkpoint: buffer {full!r} has shape {tuple(b.shape)} in the model but "
                                     f"{tuple(entry['shape'])} in {directory}")
                reader.fill(entry, f"buffer {full!r}", b.view(-1), 0, b.numel())
        if optimizer is not None:
            _load_optimizer(optimizer, targets, metadata, reader, directory)
    if restore_rng and metadata["world_size"] == comm.size and str(comm.rank) in metadata["rng"]:
        _restore_rng(directory, metadata["rng"][str(comm.rank)], reader_files=metadata, verify=verify)
    return dict(metadata.get("extra", {}), step=metadata["step"])


def _load_optimizer(optimizer: torch.optim.Optimizer, targets: dict[str, Any], metadata: dict[str, Any],
                    reader: _Reader, directory: Path) -> None:
    names = {id(p): n for n, (p, _, _, _) in targets.items()}
    saved_groups = metadata.get("param_groups", [])
    if saved_groups:
        current = [[names.get(id(p)) for p in g["params"]] for g in optimizer.param_groups]
        if [g["params"] for g in saved_groups] != current:
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
            name = names.get(id(p))
            if name is None:
                raise ValueError("load_checkpoint: the optimizer holds a parameter that is not in the model")
            _, shape, lo, hi = targets[name]
            prefix = f"optim/{name}/"
            existing = optimizer.state.get(p, {})
            state: dict[str, Any] = dict(scalars.get(name, {}))
            for key in by_param.get(name, ()):
                entry = tensors[key]
                field = key[len(prefix):]
                dtype = getattr(torch, entry["dtype"])
                follows_param = list(entry["shape"]) == list(shape) and entry["shape"] != []
                local_shape = p.shape if follows_param else torch.Size(entry["shape"])
                device = p.device if follows_param else torch.device("cpu")
                old = existing.get(field)
                # Refill the optimizer's own tensor when it fits (no allocation); every element gets written.
                if isinstance(old, torch.Tensor) and old.shape == local_shape and old.dtype == dtype:
                    value = old
                else:
                    value = torch.empty(local_shape, dtype=dtype, device=device)
                if follows_param:
                    if hi > lo:
                        reader.fill(entry, key, value.view(-1), lo, hi)
                else:
                    reader.fill(entry, key, value.view(-1), 0, value.numel())
                state[field] = value
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
