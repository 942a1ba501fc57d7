"""Reading boxes of saved tensors: each rank reads, for each box it holds, only the saved slices intersecting it.

The metadata (validated by validate.py) says which file holds which box of every tensor. `Reader.fill` intersects a
wanted box with the saved ones and copies each overlap, read as a slice by safetensors (a format-2 piece is a box
stored in its own shape, sliced on disk; a format-1 piece is a 1-D run of the global flattening, cut into boxes).
A file is opened at most once, after its path is confirmed to stay inside the checkpoint root and its size and
sha256 match the metadata; each stored tensor's shape and dtype must then match what the metadata says. Nothing
here unpickles anything.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .. import layout
from .pieces import dtype_name
from .storage import METADATA, CheckpointError, check_file_name, expect_file, inside, sha256_of

__all__ = ["Reader", "fill_held"]


class Reader:
    """Opens each shard file of one checkpoint at most once, checked first (see the module docstring)."""

    def __init__(self, root: Path, directory: Path, metadata: dict[str, Any], verify: bool,
                 stack: contextlib.ExitStack) -> None:
        self.root = root
        self.directory = directory
        self.files = metadata["files"]
        self.verify = verify
        self.stack = stack
        self.handles: dict[str, Any] = {}

    def handle(self, name: str) -> Any:
        if name not in self.handles:
            check_file_name(name, self.directory / METADATA)
            expected = self.files.get(name)
            if expected is None:
                raise CheckpointError(f"{self.directory / METADATA} refers to {name}, which it does not list")
            path = inside(self.directory / name, self.root)
            expect_file(path)
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

    def tensor(self, name: str, key: str) -> torch.Tensor:
        """The whole stored tensor `key` of file `name` (RNG states)."""
        try:
            return self.handle(name).get_tensor(key)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{self.directory / name}: cannot read {key}: {exc}") from None

    def _read(self, piece: dict[str, Any], saved: layout.Box, want: layout.Box, dtype: str) -> torch.Tensor:
        """The part `want` of a saved piece covering `saved`: a box-shaped stored tensor (format 2) is sliced on
        disk; a flat one (format 1: `offset` into a 1-D run of the global flattening) is read then reshaped."""
        handle = self.handle(piece["file"])
        key = piece["key"]
        stored = handle.get_slice(key)
        flat = "offset" in piece
        expected = [piece["hi"] - piece["lo"]] if flat else [n for _, n in saved]
        if list(stored.get_shape()) != expected:
            raise CheckpointError(f"{self.directory / piece['file']}: {key} has shape {stored.get_shape()}, the "
                                  f"metadata says {expected}")
        if not flat:
            data = handle.get_tensor(key) if not saved else stored[layout.box_slices(want, saved)]
        else:
            lo = piece["offset"]
            run = stored[lo : lo + layout.box_numel(saved)]
            data = run.reshape([n for _, n in saved])[layout.box_slices(want, saved)]
        if dtype_name(data.dtype) != dtype:
            raise CheckpointError(f"{self.directory / piece['file']}: {key} is stored as {dtype_name(data.dtype)}, "
                                  f"the metadata says {dtype}")
        return data

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
                data = self._read(piece, saved, overlap, entry["dtype"])
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


def fill_held(reader: Reader, entry: dict[str, Any], what: str, pl: layout.Placement, target: torch.Tensor) -> None:
    """Fill every box `pl` holds of `target` (a tensor shaped like pl.param) from the checkpoint."""
    for box, view in layout.held_views(pl, target.detach()):
        reader.fill(entry, what, view, box)
