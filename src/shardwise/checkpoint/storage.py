"""The on-disk layout of checkpoints and the atomic, durable file operations behind it.

    root/
      latest                      "step-00000100": the newest complete checkpoint (replaced atomically, last)
      step-00000100/
        metadata.json             every tensor's name, global shape, dtype and which file holds which slice;
                                  step, world layout, strategy, RNG states, user extras, sha256 of every file
        shard-00000-of-00004.safetensors
        ...
      .tmp-step-00000200-3f2a.../ a save in progress: renamed into place only once complete

A save writes everything into a temporary directory beside the target, fsyncs every file and the directory, renames
the directory into place, and only then replaces `latest` (write, fsync, rename). A crash at any moment leaves the
previous checkpoint and pointer intact. File names read from metadata must match a strict pattern, so a crafted
checkpoint cannot make the loader open anything outside its directory.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

__all__ = ["CheckpointError", "checkpoint_dir_name", "shard_file_name", "check_file_name", "fsync_dir",
           "write_bytes_durably", "sha256_of", "resolve_checkpoint", "update_latest", "prune"]

METADATA = "metadata.json"
LATEST = "latest"
_SHARD_RE = re.compile(r"^shard-\d{5}-of-\d{5}\.safetensors$")
_DIR_RE = re.compile(r"^step-\d{8}$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or does not fit the model; the message names the file."""


def checkpoint_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def shard_file_name(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.safetensors"


def check_file_name(name: str, where: Path) -> str:
    if not isinstance(name, str) or not _SHARD_RE.match(name):
        raise CheckpointError(f"{where}: refusing file name {name!r} (allowed: shard-NNNNN-of-NNNNN.safetensors)")
    return name


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_durably(path: Path, data: bytes) -> None:
    """Write `data` to `path` via a temporary file in the same directory, fsync, rename: all or nothing."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint directory: `path` itself if it holds metadata.json, else the one `path/latest` names."""
    root = Path(path)
    if (root / METADATA).is_file():
        return root
    pointer = root / LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        if not _DIR_RE.match(name):
            raise CheckpointError(f"{pointer}: names {name!r}, which is not a checkpoint directory name")
        target = root / name
        if not (target / METADATA).is_file():
            raise CheckpointError(f"{pointer} names {name!r} but {target / METADATA} does not exist")
        return target
    raise FileNotFoundError(f"no checkpoint at {root}: neither {root / METADATA} nor {pointer} exists")


def update_latest(root: Path, name: str) -> None:
    write_bytes_durably(root / LATEST, (name + "\n").encode())


def prune(root: Path, keep_last: int) -> list[str]:
    """Delete all but the newest `keep_last` complete checkpoints (never the one `latest` names)."""
    latest = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
    complete = sorted(p.name for p in root.iterdir() if _DIR_RE.match(p.name) and (p / METADATA).is_file())
    doomed = [n for n in complete[: max(0, len(complete) - keep_last)] if n != latest]
    for name in doomed:
        shutil.rmtree(root / name, ignore_errors=True)
    return doomed
