"""LaunchError: how `launch()` reports a failed rank, whichever way the ranks were started."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["LaunchError"]

_SHOWN = 8


class LaunchError(RuntimeError):
    """A rank of `launch` failed. `rank` is the first rank that failed (the root cause, by time); `summary` one line
    of what happened to it ("killed by SIGKILL", "ValueError: ...", "stalled: ..."); `remote_traceback` its traceback
    text (or stack). `others` lists (rank, summary) of every other rank that failed too (survivors' CommErrors, which
    name the root cause), in order of time.
    """

    def __init__(self, rank: int, summary: str, remote_traceback: str,
                 others: Sequence[tuple[int, str]] = ()) -> None:
        text = f"rank {rank} failed: {summary}\n--- traceback of rank {rank} ---\n{remote_traceback}"
        if others:
            # The first few in the message (a 64-rank job would print 63 copies of one error); all in `.others`.
            shown = [f"rank {r}: {s}" for r, s in others[:_SHOWN]]
            if len(others) > _SHOWN:
                shown.append(f"... and {len(others) - _SHOWN} more (LaunchError.others has them all)")
            text += "\n--- other ranks ---\n" + "\n".join(shown)
        super().__init__(text)
        self.rank = rank
        self.summary = summary
        self.remote_traceback = remote_traceback
        self.others = tuple(others)
