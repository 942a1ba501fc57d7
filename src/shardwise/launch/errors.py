"""LaunchError: how `launch()` reports a failed rank, whichever way the ranks were started."""

from __future__ import annotations

__all__ = ["LaunchError"]


class LaunchError(RuntimeError):
    """A rank of `launch` failed. `rank` is the first rank that failed; `remote_traceback` its traceback text."""

    def __init__(self, rank: int, summary: str, remote_traceback: str) -> None:
        super().__init__(f"rank {rank} failed: {summary}\n--- traceback of rank {rank} ---\n{remote_traceback}")
        self.rank = rank
        self.remote_traceback = remote_traceback
