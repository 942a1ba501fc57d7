"""Rank-tagged log lines: `[rank 3] INFO shardwise.ddp: ...`.

Thread ranks share one process, so the rank shown in a line is looked up per record: the rank of the thread that
logs it (set by `launch(..., backend="thread")` for each rank thread), else the rank of the process (set by `init()`
and by each spawned rank), else "-".
"""

from __future__ import annotations

import logging
import os
import sys
import threading

__all__ = ["get_logger", "set_log_rank"]

_rank_of_thread = threading.local()
_process_rank: int | None = None


class _RankFilter(logging.Filter):
    """Tags each record with the rank of the thread (thread ranks) or the process that logged it."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank = getattr(_rank_of_thread, "rank", _process_rank)
        record.rank = "-" if rank is None else rank
        return True


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time of the record (so redirection and capture keep working)."""

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # noqa: ANN001
        pass


def set_log_rank(rank: int | None, *, thread_only: bool = False) -> None:
    """Set the rank shown in log lines of this thread (thread ranks) or of the whole process."""
    global _process_rank
    if thread_only:
        _rank_of_thread.rank = rank
    else:
        _process_rank = rank


def get_logger(name: str = "shardwise") -> logging.Logger:
    """The library's logger; lines read `[rank 3] INFO shardwise.ddp: ...`. Level from SHARDWISE_LOG (default INFO)."""
    root = logging.getLogger("shardwise")
    if not any(isinstance(f, _RankFilter) for h in root.handlers for f in h.filters):
        handler = _StderrHandler()
        handler.addFilter(_RankFilter())
        handler.setFormatter(logging.Formatter("[rank %(rank)s] %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(os.environ.get("SHARDWISE_LOG", "INFO").upper())
        root.propagate = False
    return logging.getLogger(name)
