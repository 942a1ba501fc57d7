"""The on-disk layout of checkpoints and the atomic, durable file operations behind it.

    root/
      latest                      "step-00000100": the newest complete checkpoint (replaced atomically, last)
      step-00000100/
        metadata.json             every tensor's name, global shape, dtype and which file holds which slice;
                                  step, world layout, strategy, RNG states, user extras, sha256 of every file
        shard-00000-of-00004.safetensors
        ...
      .tmp-step-00000200-3f2a.../ a save in progress: renamed into place only once complete
      .lock-step-00000200-3f2a... held (flock) by rank 0 while that save runs

A save writes everything into a temporary directory beside the target, fsyncs every file and the directory, renames
the directory into place, and only then replaces `latest` (write, fsync, rename). A crash at any moment leaves the
previous checkpoint and pointer intact; what the dead save left (`.tmp-*`, `.old-*`) is removed by the next save,
which tells a dead save from one in progress by its lock: the kernel releases a dead process's flock.

A crafted checkpoint cannot make the loader open anything outside the checkpoint root: file names read from metadata
must match a strict pattern, and every path the loader opens (metadata, shard files, the directory `latest` names,
`latest` itself) is resolved through its symlinks and must stay inside the root.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

from ..files import fsync_dir, write_bytes_durably  # noqa: F401 - their home; the checkpoint writers use them

try:
    import fcntl
except ImportError:  # not POSIX: saves take no lock, and leftovers that carry one are never removed
    fcntl = None  # type: ignore[assignment]

__all__ = ["CheckpointError", "CheckpointMismatch", "checkpoint_dir_name", "shard_file_name", "check_file_name",
           "fsync_dir", "write_bytes_durably", "sha256_of", "inside", "expect_file", "resolve_checkpoint",
           "update_latest", "prune", "SaveLock", "remove_stale"]

FORMAT = "shardwise-checkpoint"
VERSION = 2  # 2: pieces are boxes of the global tensor (any layout); 1: flat ranges (read too, see reader.py)
READABLE_VERSIONS = (1, 2)
METADATA = "metadata.json"
LATEST = "latest"
_SHARD_RE = re.compile(r"^shard-\d{5}-of-\d{5}\.safetensors$")
_DIR_RE = re.compile(r"^step-\d{8}$")
_LEFTOVER_RE = re.compile(r"^\.(tmp|old|lock)-(step-\d{8}-[0-9A-Za-z]+)$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or does not fit the model; the message names the file."""


class CheckpointMismatch(CheckpointError, ValueError):
    """A sound checkpoint that does not fit the model or optimizer (strict loading): missing or unexpected tensors,
    other shapes or dtypes, another optimizer type. A ValueError too, as shape mismatches always were."""


def checkpoint_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def shard_file_name(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.safetensors"


def check_file_name(name: str, where: Path) -> str:
    if not isinstance(name, str) or not _SHARD_RE.match(name):
        raise CheckpointError(f"{where}: refusing file name {name!r} (allowed: shard-NNNNN-of-NNNNN.safetensors)")
    return name


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def inside(path: Path, root: Path) -> Path:
    """`path` with its symlinks resolved, refused (CheckpointError naming it) unless it stays inside `root`."""
    real, base = path.resolve(), root.resolve()
    if real != base and base not in real.parents:
        raise CheckpointError(f"{path} leads outside the checkpoint root {base} (a symlink to {real}); refusing to "
                              f"follow it")
    return real


def expect_file(path: Path) -> None:
    """A CheckpointError naming `path` unless it is a regular file: missing, or a directory, said as such."""
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory, expected a file")
    if not path.is_file():
        raise CheckpointError(f"{path} is missing" if not path.exists() else f"{path} is not a regular file")


def resolve_checkpoint(path: str | os.PathLike) -> tuple[Path, Path]:
    """(root, directory), both with symlinks resolved: `path` itself if it holds metadata.json (then it is its own
    root), else the directory `path/latest` names, which must stay inside `path`."""
    given = Path(path)
    if given.exists() and not given.is_dir():
        raise CheckpointError(f"{given} is a file; a checkpoint is a directory (a step directory or a root with "
                              f"`latest`)")
    root = given.resolve()
    if (given / METADATA).exists():
        inside(given / METADATA, root)
        return root, root
    pointer = given / LATEST
    if pointer.exists():
        expect_file(inside(pointer, root))
        name = pointer.read_text().strip()
        if not _DIR_RE.match(name):
            raise CheckpointError(f"{pointer}: names {name!r}, which is not a checkpoint directory name")
        target = inside(given / name, root)
        if not (target / METADATA).exists():
            raise CheckpointError(f"{pointer} names {name!r} but {given / name / METADATA} does not exist")
        return root, target
    raise FileNotFoundError(f"no checkpoint at {given}: neither {given / METADATA} nor {pointer} exists")


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


class SaveLock:
    """Rank 0's exclusive flock on `root/.lock-<ident>` for the whole save: while it is held, no later save removes
    this save's temporary directory; the kernel releases it if the process dies. No-op where there is no flock."""

    def __init__(self, root: Path, ident: str) -> None:
        self.path = root / f".lock-{ident}"
        self.fd: int | None = None
        if fcntl is not None:
            self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new name (uuid): nobody else holds it

    def release(self) -> None:
        """Remove the lock file and drop the lock; idempotent (a failed save releases it on every path)."""
        fd, self.fd = self.fd, None
        if fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(fd)


def _in_progress(lock: Path) -> bool:
    """Whether a live process holds `lock`; a dead save's lock was released by the kernel when it died."""
    if fcntl is None:
        return lock.exists()
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def remove_stale(root: Path, current: str) -> list[str]:
    """Rank 0, at the start of a save: delete what dead saves left in `root` (`.tmp-<id>` directories, `.old-<id>`
    replaced steps, `.lock-<id>` files), except the current save's and those of saves still in progress."""
    leftovers: dict[str, list[Path]] = {}
    for entry in root.iterdir():
        match = _LEFTOVER_RE.match(entry.name)
        if match and match.group(2) != current:
            leftovers.setdefault(match.group(2), []).append(entry)
    removed = []
    for ident, entries in sorted(leftovers.items()):
        if _in_progress(root / f".lock-{ident}"):
            continue
        for entry in sorted(entries, key=lambda e: e.name.startswith(".lock-")):  # the lock last
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry.name)
    return removed
