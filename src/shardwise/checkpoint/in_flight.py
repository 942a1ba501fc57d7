"""Asynchronous saves still writing when the process exits are finished first, not lost.

`save_checkpoint(..., async_save=True)` writes on a daemon thread. A script whose last line is such a save (or that
never waits for its handle) would otherwise exit while the thread writes: the interpreter ends daemon threads at
exit, so the checkpoint would stay a hidden temporary directory and the job would lose its last save without a
word. Every save started in the background is tracked here until its handle is waited; at exit (an atexit hook,
which runs before the interpreter ends its threads) the ones still tracked are waited, and an error of theirs is
logged (nothing can be raised any more). The wait is bounded by the save's own limits: rank 0 finishes once every
rank's index is there or the save's timeout passed.
"""

from __future__ import annotations

import atexit
import logging
import threading
from typing import Any

__all__ = ["track", "untrack"]

log = logging.getLogger("shardwise.checkpoint")
_lock = threading.Lock()
_handles: list[Any] = []  # SaveHandles in flight, strongly held: a handle the script dropped is still finished
_hooked = False


def track(handle: Any) -> None:
    """Finish `handle` (a SaveHandle whose writer thread has started) at exit unless it is waited before."""
    global _hooked
    with _lock:
        _handles.append(handle)
        if not _hooked:
            atexit.register(_finish_at_exit)
            _hooked = True


def untrack(handle: Any) -> None:
    with _lock:
        if handle in _handles:
            _handles.remove(handle)


def _finish_at_exit() -> None:
    with _lock:
        pending = list(_handles)
    for handle in pending:
        if handle.thread is not None and handle.thread.is_alive():
            log.warning("waiting for the asynchronous save of %s to finish before exiting", handle.path)
        try:
            handle.wait()
        except BaseException as exc:  # noqa: BLE001 - nothing may be raised at exit: say it
            log.error("the asynchronous save of %s failed: %s: %s", handle.path, type(exc).__name__, exc)
