"""`save_checkpoint`: every rank writes only what it holds; one metadata file describes the whole; atomic.

Steps (see storage.py for the layout):
1. Rank 0 picks the step and a temporary directory name and broadcasts them (the only collectives besides step 2
   and the final barrier).
2. Every rank lists its pieces (pieces.py) and the strategy state it declares (strategy_state.py); the lists are
   exchanged and each distinct piece gets exactly one writer, the holder with the fewest bytes assigned so far, so
   replicated state (DDP, hybrid replicas) is written once and the writing is spread over the ranks; per-rank
   strategy state (a compressor's residuals) is written by every rank.
3. Each rank copies its assigned pieces to host memory, serialises them with safetensors, writes its file durably
   and then an index file listing its pieces and the file's sha256.
4. Rank 0 waits for every index, writes metadata.json, renames the directory into place, then moves `latest`
   and prunes old checkpoints.
With `async_save=True` steps 3-4 run on a background thread (training goes on: the snapshot of step 3 is taken
before returning); they use no collectives, only the filesystem, so they never interleave with the training's.
`handle.wait()` joins; on rank 0 it returns once the checkpoint is in place. A save never waited is finished when
the process exits (in_flight.py).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save as safetensors_save
from torch import nn

from .. import layout
from ..comm.base import Communicator
from ..comm.objects import all_gather_json, broadcast_json
from ..dropout_stream import stream_positions
from ..whole.replicas import check_replicas
from . import in_flight
from .barrier import DEFAULT_IO_TIMEOUT, io_barrier
from ..whole.optim_state import optimizer_names
from .pieces import local_pieces
from .strategy_state import declared_states, merge_indexes, save_problems, snapshot
from .storage import (
    FORMAT,
    METADATA,
    VERSION,
    CheckpointError,
    SaveLock,
    checkpoint_dir_name,
    fsync_dir,
    prune,
    remove_stale,
    shard_file_name,
    update_latest,
    write_bytes_durably,
)

__all__ = ["save_checkpoint", "SaveHandle", "model_comm", "strategy_name"]

log = logging.getLogger("shardwise.checkpoint")


def model_comm(model: nn.Module, comm: Communicator | None) -> Communicator:
    """The communicator spanning every rank that holds a piece of `model` (ValueError when it cannot be known)."""
    if comm is not None:
        return comm
    return layout.model_world(model, "checkpoint")


def strategy_name(model: nn.Module) -> str:
    """The strategies applied, innermost first ("tensor_parallel + zero3"), or "none"."""
    return " + ".join(r.name for r in layout.strategies(model)) or "none"


class SaveHandle:
    """A save in flight (or done). `wait()` re-raises any error of the background writer."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def wait(self) -> Path:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        in_flight.untrack(self)
        if self.error is not None:
            raise self.error
        return self.path


def _rng_state(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {"rng/torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng/cuda{i}"] = state
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    as_json = {"python": [version, list(internal), gauss],
               "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
               "dropout": stream_positions(model)}
    return tensors, as_json


def _piece_id(p: dict[str, Any]) -> tuple[str, str]:
    return p["name"], json.dumps(p["box"])


def _assign_writers(all_pieces: list[list[dict[str, Any]]]) -> dict[tuple[str, str], int]:
    """One writer per distinct piece (replicas hold equal boxes): the holder with the least bytes assigned so far."""
    holders: dict[tuple[str, str], list[int]] = {}
    sizes: dict[tuple[str, str], int] = {}
    for rank, pieces in enumerate(all_pieces):
        for p in pieces:
            key = _piece_id(p)
            holders.setdefault(key, []).append(rank)
            sizes[key] = p["nbytes"]
    load = [0] * len(all_pieces)
    writer: dict[tuple[str, str], int] = {}
    for key in sorted(holders, key=lambda k: (-sizes[k], k)):
        chosen = min(holders[key], key=lambda r: (load[r], r))
        writer[key] = chosen
        load[chosen] += sizes[key]
    return writer


def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    step: int | None = None,
    *,
    comm: Communicator | None = None,
    keep_last: int | None = None,
    async_save: bool = False,
    timeout: float = DEFAULT_IO_TIMEOUT,
    **extra: Any,
) -> SaveHandle:
    """Save a sharded checkpoint of `model` (and `optimizer`) under the directory `path`; collective.

    step: names the checkpoint (`step-00000100`); None takes the next number after the newest one.
    keep_last: afterwards delete all but the newest `keep_last` checkpoints.
    timeout: seconds the I/O may take (rank 0 waiting for the shards, every rank waiting for rank 0 to put the
        checkpoint in place): the checkpoint's own, sized for large shards on a parallel file system, not the
        communicator's collective timeout.
    async_save: write on a background thread; call `.wait()` on the returned handle before the next save.
    extra: JSON-serialisable values stored in the metadata and returned by `load_checkpoint` (e.g. the data
        position: `data=sampler.state_dict()`).
    The state strategies declare besides parameters and optimizer (`layout.ExtraState`: a compressor's residuals
    per rank, local SGD's anchors; see strategy_state.py) is saved with them.
    """
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"save_checkpoint: step={step!r} must be a non-negative int or None")
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"save_checkpoint: keep_last={keep_last!r} must be a positive int or None")
    try:
        json.dumps(extra)
    except TypeError as exc:
        raise ValueError(f"save_checkpoint: extra values must be JSON-serialisable: {exc}") from None
    comm = model_comm(model, comm)
    root = Path(path)
    plan: dict[str, Any] | None = None
    lock: SaveLock | None = None
    if comm.rank == 0:
        try:
            plan, lock = _start(root, step)
        except (OSError, CheckpointError) as exc:
            plan = {"error": str(exc) if isinstance(exc, CheckpointError) else
                    f"save_checkpoint: cannot use {root} as the checkpoint root: {exc.strerror or exc}"}
    plan = broadcast_json(comm, plan)  # an error on rank 0 reaches every rank, which would otherwise wait for it
    if "error" in plan:
        raise CheckpointError(plan["error"])
    try:
        return _save(root, plan["id"], plan["step"], lock, model, optimizer, comm, keep_last, async_save, timeout,
                     extra)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def _start(root: Path, step: int | None) -> tuple[dict[str, Any], SaveLock]:
    """Rank 0: create the root, pick the step and this save's id, take its lock, remove dead saves' leftovers."""
    blocker = next((p for p in (root, *root.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise CheckpointError(f"save_checkpoint: {blocker} is a file; the checkpoint root {root} must be a directory "
                              f"(or not exist yet)")
    root.mkdir(parents=True, exist_ok=True)
    if step is None:
        existing = [int(p.name[5:]) for p in root.glob("step-*") if p.name[5:].isdigit()]
        step = max(existing, default=-1) + 1
    ident = f"{checkpoint_dir_name(step)}-{uuid.uuid4().hex}"
    lock = SaveLock(root, ident)
    removed = remove_stale(root, ident)
    if removed:
        log.info("save_checkpoint: removed what dead saves left in %s: %s", root, removed)
    return {"step": step, "id": ident}, lock


def _save(root: Path, ident: str, step: int, lock: SaveLock | None, model: nn.Module,
          optimizer: torch.optim.Optimizer | None, comm: Communicator, keep_last: int | None, async_save: bool,
          timeout: float, extra: dict[str, Any]) -> SaveHandle:
    """Every rank: snapshot and write what it holds into `.tmp-<ident>`; rank 0 then puts the checkpoint in place."""
    tmp = root / f".tmp-{ident}"
    final = root / checkpoint_dir_name(step)
    if comm.rank != 0:
        root.mkdir(parents=True, exist_ok=True)
    tmp.mkdir(exist_ok=True)
    if tmp.is_symlink():  # a link planted under this save's name: never write through it
        raise CheckpointError(f"save_checkpoint: {tmp} is a symbolic link; a save writes only into a directory it "
                              f"made (remove the link)")

    check_replicas(model)  # copies that drifted apart raise, naming the tensor: never save one rank's as everyone's
    pieces = local_pieces(model, optimizer)
    states = declared_states(model, optimizer)
    # What is wrong with this rank's strategy state travels with its pieces: every rank then raises, none waits.
    gathered = all_gather_json(comm, {"pieces": [p.describe() for p in pieces], "problems": save_problems(states, comm),
                                      "replicated": sorted(n for n, s in states.items() if s.scope == "replicated")})
    problems = [f"rank {r}: {p}" for r, g in enumerate(gathered) for p in g["problems"]]
    if problems:
        raise ValueError(f"save_checkpoint: {'; '.join(problems[:10])}")
    writers = _assign_writers([g["pieces"] for g in gathered])
    mine = [p for p in pieces if writers[_piece_id(p.describe())] == comm.rank]
    # A replicated state is written once, by the lowest rank declaring it; a per-rank one by every rank.
    first = {}
    for r, g in reversed(list(enumerate(gathered))):
        first.update({name: r for name in g["replicated"]})
    state_tensors, state_index = snapshot(
        states, {n for n, s in states.items() if s.scope == "per_rank" or first[n] == comm.rank}, comm.rank,
        shard_file_name(comm.rank, comm.size))
    # The snapshot: host copies, taken now, so training may change the live tensors right after we return.
    tensors = {p.key: p.tensor.detach().to("cpu", copy=True).contiguous() for p in mine}
    rng_tensors, rng_json = _rng_state(model)
    tensors.update({f"{k}@{comm.rank}": v.clone() for k, v in rng_tensors.items()})
    tensors.update(state_tensors)
    file_name = shard_file_name(comm.rank, comm.size)
    index = {
        "rank": comm.rank,
        "file": file_name,
        "pieces": [dict(p.describe(), key=p.key) for p in mine],
        "rng": {"json": rng_json, "tensors": {k: f"{k}@{comm.rank}" for k in rng_tensors}},
        "optim_scalars": _optimizer_scalars(model, optimizer),
        "param_groups": _param_groups(model, optimizer),
        "strategy_state": state_index,
    }
    header = None
    if comm.rank == 0:
        header = {"format": FORMAT, "version": VERSION, "step": step, "world_size": comm.size,
                  "strategy": strategy_name(model), "extra": extra,
                  "optimizer": None if optimizer is None else type(optimizer).__name__}

    handle = SaveHandle(final)

    def write() -> None:
        try:
            data = safetensors_save(tensors)
            write_bytes_durably(tmp / file_name, data)
            import hashlib

            index["sha256"] = hashlib.sha256(data).hexdigest()
            index["bytes"] = len(data)
            # The index says this rank is done: rank 0 may then merge it and rename the directory at once, so this
            # rank does not fsync the directory after it (it would find it gone); rank 0 fsyncs it before the rename.
            write_bytes_durably(tmp / f"index-{comm.rank:05d}.json", json.dumps(index).encode(), sync_directory=False)
            if comm.rank == 0:
                _finish(root, tmp, final, header, comm.size, keep_last, timeout)
        except BaseException as exc:  # noqa: BLE001 - surfaced by wait()
            handle.error = exc
        finally:
            if lock is not None:
                lock.release()

    if async_save:
        handle.thread = threading.Thread(target=write, name=f"shardwise-save-rank{comm.rank}", daemon=True)
        handle.thread.start()
        in_flight.track(handle)  # finished at exit if never waited (in_flight.py)
        return handle
    write()
    io_barrier(comm, timeout)  # when save_checkpoint returns on any rank, the checkpoint is complete
    handle.wait()
    return handle


def _finish(root: Path, tmp: Path, final: Path, header: dict[str, Any], world: int, keep_last: int | None,
            timeout: float) -> None:
    """Rank 0: merge the indexes into metadata.json, rename the directory into place, move `latest`, prune."""
    deadline = time.monotonic() + timeout
    names = [tmp / f"index-{r:05d}.json" for r in range(world)]
    while not all(n.is_file() for n in names):
        if time.monotonic() > deadline:
            missing = [n.name for n in names if not n.is_file()]
            raise CheckpointError(f"save of {final}: ranks did not finish writing within {timeout:g}s: {missing}")
        time.sleep(0.01)
    tensors: dict[str, dict[str, Any]] = {}
    files: dict[str, dict[str, Any]] = {}
    rng: dict[str, Any] = {}
    optim_scalars: dict[str, Any] = {}
    param_groups: list[dict[str, Any]] = []
    strategy_state: dict[str, Any] = {}
    for name in names:
        index = json.loads(name.read_text())
        merge_indexes(strategy_state, index["rank"], index["strategy_state"])
        files[index["file"]] = {"sha256": index["sha256"], "bytes": index["bytes"]}
        rng[str(index["rank"])] = dict(index["rng"], file=index["file"])
        for key, values in index["optim_scalars"].items():
            optim_scalars.setdefault(key, values)
        _merge_groups(param_groups, index["param_groups"])
        for p in index["pieces"]:
            entry = tensors.setdefault(p["name"], {"shape": p["shape"], "dtype": p["dtype"],
                                                   "follows_param": p["follows_param"], "pieces": []})
            entry["pieces"].append({"file": index["file"], "key": p["key"], "box": p["box"]})
    metadata = dict(header, files=files, tensors=tensors, rng=rng, optim_scalars=optim_scalars,
                    param_groups=param_groups, strategy_state=strategy_state)
    write_bytes_durably(tmp / METADATA, json.dumps(metadata, indent=1).encode())
    for name in names:
        name.unlink()
    fsync_dir(tmp)
    if final.exists():  # re-saving a step: move the old one aside first, never leave a half state under its name
        old = root / f".old-{tmp.name.removeprefix('.tmp-')}"  # tied to this save's lock (storage.remove_stale)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(root)
    update_latest(root, final.name)
    if keep_last is not None:
        prune(root, keep_last)


def _param_names(model: nn.Module) -> dict[int, str]:
    return {pid: pl.name for pid, pl in optimizer_names(model).items()}


def _merge_groups(merged: list[dict[str, Any]], groups: list[dict[str, Any]]) -> None:
    """Group i of the checkpoint holds every rank's group i: pipeline stages hold different parameters."""
    for i, group in enumerate(groups):
        if i == len(merged):
            merged.append(dict(group, params=[]))
        known = set(merged[i]["params"])
        merged[i]["params"] += [n for n in group["params"] if n not in known]


def _param_groups(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[dict[str, Any]]:
    if optimizer is None:
        return []
    names = _param_names(model)
    groups = []
    for group in optimizer.param_groups:
        entry = {k: v for k, v in group.items() if k != "params" and _jsonable(v)}
        entry["params"] = [names[id(p)] for p in group["params"]]
        groups.append(entry)
    return groups


def _optimizer_scalars(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        return {}
    names = _param_names(model)
    out = {}
    for p, state in optimizer.state.items():
        plain = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor) and _jsonable(v)}
        if plain and id(p) in names:
            out[names[id(p)]] = plain
    return out


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False
