"""What a checkpoint's metadata may say, checked before anything is allocated, opened or read.

`read_metadata` parses metadata.json and checks its whole structure: the required keys and their types, every file
name against the shard pattern with its size and sha256, every tensor's dtype against a fixed list of tensor dtypes
(a name like "zeros" is refused: it is looked up in that list, never as an attribute of torch), every shape and
box as non-negative ints inside the tensor, and every tensor's size against the bytes of the files said to hold it
(a valid checkpoint stores every element, so a 10^12-element shape in a file of a few kB is refused before
anything is allocated). The "strategy_state" section (strategy_state.py) is checked the same way. `rng_states` checks one rank's RNG entry by loading it into fresh generators, never the
process's own. Every error is a CheckpointError naming the file and the key or tensor.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .pieces import dtype_name
from .storage import FORMAT, METADATA, READABLE_VERSIONS, VERSION, CheckpointError, check_file_name, expect_file, inside

__all__ = ["DTYPES", "read_metadata", "validate_metadata", "tensor_dtype", "rng_states"]

_DTYPE_LIST = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
               torch.bfloat16, torch.float32, torch.float64, torch.complex64]
_DTYPE_LIST += [getattr(torch, n) for n in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2")
                if isinstance(getattr(torch, n, None), torch.dtype)]
DTYPES: dict[str, torch.dtype] = {dtype_name(d): d for d in _DTYPE_LIST}
_MAX_DIMS = 64


def tensor_dtype(name: Any, where: str) -> torch.dtype:
    """The torch dtype a checkpoint's dtype name stands for; only the names of DTYPES are accepted."""
    if not isinstance(name, str) or name not in DTYPES:
        raise CheckpointError(f"{where}: dtype {name!r} is not a tensor dtype (allowed: {', '.join(DTYPES)})")
    return DTYPES[name]


def read_metadata(directory: Path, root: Path | None = None) -> dict[str, Any]:
    """metadata.json of the checkpoint `directory` (inside `root`, its own root by default), parsed and validated."""
    path = directory / METADATA
    inside(path, root if root is not None else directory)
    expect_file(path)
    try:
        metadata = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON (truncated or corrupt): {exc}") from None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a shardwise checkpoint")
    if metadata.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(f"{path} has format version {metadata.get('version')!r}; this shardwise writes "
                              f"{VERSION} and reads {list(READABLE_VERSIONS)}")
    validate_metadata(metadata, path)
    return metadata


def _is_int(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _need(mapping: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str, what: str = "") -> Any:
    if key not in mapping:
        raise CheckpointError(f"{where}: {what}missing key {key!r}")
    value = mapping[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise CheckpointError(f"{where}: {what}key {key!r} must be of type {names}, got {type(value).__name__}")
    return value


_OPTIONAL = {"extra": dict, "rng": dict, "optim_scalars": dict, "param_groups": list, "strategy": str,
             "optimizer": (str, type(None)), "strategy_state": dict}


def validate_metadata(metadata: dict[str, Any], path: Path) -> None:
    """Check the structure of parsed metadata (see the module docstring); CheckpointError naming `path` and the key."""
    where = str(path)
    for key in ("step", "world_size"):
        if not _is_int(_need(metadata, key, int, where), 0 if key == "step" else 1):
            raise CheckpointError(f"{where}: key {key!r} must be a {'non-negative' if key == 'step' else 'positive'} "
                                  f"int, got {metadata[key]!r}")
    files = _need(metadata, "files", dict, where)
    tensors = _need(metadata, "tensors", dict, where)
    for key, kind in _OPTIONAL.items():
        if key in metadata and not isinstance(metadata[key], kind):
            raise CheckpointError(f"{where}: key {key!r} has the wrong type ({type(metadata[key]).__name__})")
    for name, entry in files.items():
        check_file_name(name, path)
        if not isinstance(entry, dict):
            raise CheckpointError(f"{where}: files[{name!r}] must be an object")
        _need(entry, "sha256", str, where, f"files[{name!r}]: ")
        if not _is_int(_need(entry, "bytes", int, where, f"files[{name!r}]: ")):
            raise CheckpointError(f"{where}: files[{name!r}]: 'bytes' must be a non-negative int")
    for name, entry in tensors.items():
        _validate_tensor(name, entry, files, where)
    for name, entry in metadata.get("strategy_state", {}).items():
        _validate_strategy_state(name, entry, files, where)


def _validate_tensor(name: str, entry: Any, files: dict[str, Any], where: str) -> None:
    what = f"tensor {name!r}: "
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: {what}must be an object")
    shape = _need(entry, "shape", list, where, what)
    if len(shape) > _MAX_DIMS or not all(_is_int(n) for n in shape):
        raise CheckpointError(f"{where}: {what}shape {shape!r} must be at most {_MAX_DIMS} non-negative ints")
    dtype = tensor_dtype(_need(entry, "dtype", str, where, what), f"{where}: {what[:-2]}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = math.prod(shape)
    pieces = _need(entry, "pieces", list, where, what)
    holders: set[str] = set()
    for i, piece in enumerate(pieces):
        at = f"{what}piece {i}: "
        if not isinstance(piece, dict):
            raise CheckpointError(f"{where}: {at}must be an object")
        file = _need(piece, "file", str, where, at)
        if file not in files:
            raise CheckpointError(f"{where}: {at}refers to {file!r}, which 'files' does not list")
        _need(piece, "key", str, where, at)
        if "box" in piece:
            box = _need(piece, "box", list, where, at)
            if len(box) != len(shape) or not all(
                    isinstance(b, list) and len(b) == 2 and _is_int(b[0]) and _is_int(b[1]) and b[0] + b[1] <= n
                    for b, n in zip(box, shape)):
                raise CheckpointError(f"{where}: {at}box {box!r} is not inside shape {shape}")
            count = math.prod(b[1] for b in box)
        else:
            lo, hi = piece.get("lo"), piece.get("hi")
            if not (_is_int(lo) and _is_int(hi) and lo <= hi <= numel):
                raise CheckpointError(f"{where}: {at}needs a 'box', or 'lo' <= 'hi' within {numel} elements")
            count = hi - lo
        if count * itemsize > files[file]["bytes"]:
            raise CheckpointError(f"{where}: {at}{count} elements of {entry['dtype']} do not fit in {file} "
                                  f"({files[file]['bytes']} bytes)")
        holders.add(file)
    stored = sum(files[f]["bytes"] for f in holders)
    if numel * itemsize > stored:
        raise CheckpointError(f"{where}: {what}shape {shape} ({numel} elements of {entry['dtype']}) is larger than "
                              f"the {stored} bytes of the files holding it")
    if "follows_param" in entry and not isinstance(entry["follows_param"], bool):
        raise CheckpointError(f"{where}: {what}'follows_param' must be true or false")


def _validate_strategy_state(name: str, entry: Any, files: dict[str, Any], where: str) -> None:
    """One declared strategy state (strategy_state.py): its scope, configuration and, per saved copy, the file
    holding its tensors, each tensor's key, shape and dtype (bounded by the file's bytes), its plain values."""
    what = f"strategy state {name!r}: "
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: {what}must be an object")
    scope = _need(entry, "scope", str, where, what)
    if scope not in ("per_rank", "replicated"):
        raise CheckpointError(f"{where}: {what}scope {scope!r} is not 'per_rank' or 'replicated'")
    _need(entry, "config", dict, where, what)
    copies = _need(entry, "copies", dict, where, what)
    if scope == "replicated" and len(copies) != 1:
        raise CheckpointError(f"{where}: {what}a replicated state has one saved copy, not {len(copies)}")
    for rank, copy in copies.items():
        at = f"{what}copy of rank {rank}: "
        if not (isinstance(rank, str) and rank.isdigit()) or not isinstance(copy, dict):
            raise CheckpointError(f"{where}: {at}must be an object under a rank number")
        file = _need(copy, "file", str, where, at)
        if file not in files:
            raise CheckpointError(f"{where}: {at}refers to {file!r}, which 'files' does not list")
        for key in ("group_size", "group_rank"):
            if key not in copy or not (copy[key] is None or _is_int(copy[key])):
                raise CheckpointError(f"{where}: {at}{key!r} must be a non-negative int or null")
        _need(copy, "values", dict, where, at)
        for key, tensor in _need(copy, "tensors", dict, where, at).items():
            if not isinstance(tensor, dict):
                raise CheckpointError(f"{where}: {at}tensor {key!r} must be an object")
            _need(tensor, "key", str, where, f"{at}tensor {key!r}: ")
            shape = _need(tensor, "shape", list, where, f"{at}tensor {key!r}: ")
            if len(shape) > _MAX_DIMS or not all(_is_int(n) for n in shape):
                raise CheckpointError(f"{where}: {at}tensor {key!r}: shape {shape!r} must be non-negative ints")
            dtype = tensor_dtype(_need(tensor, "dtype", str, where, f"{at}tensor {key!r}: "), f"{where}: {at}{key!r}")
            if math.prod(shape) * torch.empty((), dtype=dtype).element_size() > files[file]["bytes"]:
                raise CheckpointError(f"{where}: {at}tensor {key!r} of shape {shape} does not fit in {file} "
                                      f"({files[file]['bytes']} bytes)")


def rng_states(saved: Any, where: str, rank: int) -> tuple[tuple[Any, ...], tuple[Any, ...], dict[str, str], str]:
    """One rank's RNG entry as (Python state, NumPy state, {generator: tensor key}, file), each loaded into a fresh
    generator first so that a malformed entry raises here (naming `where` and the rank), never half-applied."""
    try:
        version, internal, gauss = saved["json"]["python"]
        python = (version, tuple(internal), gauss)
        random.Random().setstate(python)
        kind, keys, pos, has_gauss, cached = saved["json"]["numpy"]
        numpy_state = (kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached)
        np.random.RandomState().set_state(numpy_state)
        tensors, file = saved["tensors"], saved["file"]
        if not isinstance(tensors, dict) or not all(isinstance(v, str) for v in tensors.values()):
            raise TypeError("'tensors' must map generator names to tensor keys")
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any malformation, reported as such
        raise CheckpointError(f"{where}: the RNG entry of rank {rank} is malformed "
                              f"({type(exc).__name__}: {exc})") from None
    return python, numpy_state, tensors, check_file_name(file, Path(where))
