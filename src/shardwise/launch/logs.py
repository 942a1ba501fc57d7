"""Rank-tagged log lines, `[rank 3] INFO shardwise.ddp: ...`, installed only when the user asks for them.

Library modules log through plain `logging.getLogger("shardwise.<module>")` and install nothing at import, as a
library should: until the user opts in, their records propagate to the root logger and the application's own
logging configuration decides what is shown (Python's last-resort handler prints warnings and errors).

`get_logger()` is the opt-in. The first call installs one handler on the "shardwise" logger that writes rank-tagged
lines to stderr, sets that logger's level from SHARDWISE_LOG (default INFO) and stops propagation to the root (so a
line is not printed twice); later calls install nothing. Ranks that `launch()` starts in processes afterwards
(gloo, mpi) install it as well, so their lines are tagged too.

Thread ranks share one process, so the rank shown in a line is looked up per record: the rank of the thread that
logs it (set by `launch(..., backend="thread")` for each rank thread), else the rank of the process (set by `init()`
and by each spawned rank), else "-".
"""

from __future__ import annotations

import logging
import os
import sys
import threading

__all__ = ["get_logger", "rank_logging_installed", "set_log_rank", "start_rank_logging"]

_ROOT = "shardwise"
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


def rank_logging_installed() -> bool:
    """Whether `get_logger()` installed the rank-tagged handler in this process (launch() passes it on to ranks)."""
    return any(isinstance(f, _RankFilter) for h in logging.getLogger(_ROOT).handlers for f in h.filters)


def get_logger(name: str = _ROOT) -> logging.Logger:
    """The logger `name` (default "shardwise"), after installing the rank-tagged stderr handler once (see above).

    Lines read `[rank 3] INFO shardwise.ddp: ...`; the level comes from SHARDWISE_LOG (default INFO).
    """
    if not rank_logging_installed():
        handler = _StderrHandler()
        handler.addFilter(_RankFilter())
        handler.setFormatter(logging.Formatter("[rank %(rank)s] %(levelname)s %(name)s: %(message)s"))
        root = logging.getLogger(_ROOT)
        root.addHandler(handler)
        root.setLevel(os.environ.get("SHARDWISE_LOG", "INFO").upper())
        root.propagate = False
    return logging.getLogger(name)


def start_rank_logging(rank: int, install: bool) -> None:
    """In a rank process that launch() started: tag lines with `rank`, and install the handler if the parent had."""
    set_log_rank(rank)
    if install:
        get_logger()
