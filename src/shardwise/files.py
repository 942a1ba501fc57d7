"""Writing result files so that nothing planted in their folder is written through.

`write_bytes_durably(path, data)` writes via a temporary file in the same directory, created new (O_CREAT | O_EXCL |
O_NOFOLLOW: a file or link already under its name, left by a dead writer or planted to point elsewhere, is removed,
never written through), fsynced, then renamed over `path` (which replaces a link at `path` itself, not what it
points to): all or nothing. Checkpoints, exports, the demo's and the benchmarks' run folders all write through it;
`write_text` and `save_figure` are its text and matplotlib forms.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

__all__ = ["fsync_dir", "write_bytes_durably", "write_text", "save_figure"]


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_durably(path: Path, data: bytes, sync_directory: bool = True) -> None:
    """Write `data` to `path` via a new temporary file, fsync, rename (see the module docstring), then fsync the
    directory, unless `sync_directory` is False: for a file whose appearance hands the directory to another writer,
    who may rename it at once and syncs it itself (a checkpoint rank's index, checkpoint/save.py)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(tmp, flags, 0o644)
    except FileExistsError:
        os.unlink(tmp)  # a link is removed itself; its target is untouched
        fd = os.open(tmp, flags, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    if sync_directory:
        fsync_dir(path.parent)


def write_text(path: Path, text: str) -> None:
    """`text` (UTF-8) to `path`, as write_bytes_durably."""
    write_bytes_durably(Path(path), text.encode())


def save_figure(fig: Any, path: Path, **savefig_kwargs: Any) -> None:
    """A matplotlib figure rendered in memory, then written as write_bytes_durably (savefig itself follows links)."""
    buf = io.BytesIO()
    fig.savefig(buf, format=Path(path).suffix.lstrip(".") or "png", **savefig_kwargs)
    write_bytes_durably(Path(path), buf.getvalue())
