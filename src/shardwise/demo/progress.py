"""Rank 0's progress display: a tqdm bar on a terminal, plain lines anywhere else.

tqdm redraws its bar in place with carriage returns; written to a file or a pipe (a CI log, `| tee`, a batch
system's output file) those redraws pile up into one line thousands of characters long. Off a terminal the demo
therefore prints a short line every tenth of the run instead (and at the end), each with the same figures.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

__all__ = ["progress_bar", "LineProgress"]


class LineProgress:
    """tqdm's update / set_postfix / close, printed as a whole line every `every` steps and at the last one."""

    def __init__(self, total: int, desc: str, unit: str, out: TextIO) -> None:
        self.total, self.desc, self.unit, self.out = total, desc, unit, out
        self.n, self.postfix = 0, ""
        self.every = max(1, total // 10)

    def set_postfix(self, **figures: Any) -> None:
        self.postfix = " ".join(f"{k}={v}" for k, v in figures.items())

    def update(self, n: int = 1) -> None:
        before, self.n = self.n, self.n + n
        if self.n // self.every > before // self.every or self.n >= self.total:
            print(f"{self.desc}: {self.n}/{self.total} {self.unit}s {self.postfix}".rstrip(), file=self.out,
                  flush=True)

    def close(self) -> None:
        pass


def progress_bar(total: int, desc: str, unit: str = "step", out: TextIO | None = None) -> Any:
    """A tqdm bar when `out` (default stderr) is a terminal, else a `LineProgress`."""
    out = out if out is not None else sys.stderr
    if not (hasattr(out, "isatty") and out.isatty()):
        return LineProgress(total, desc, unit, out)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=out, dynamic_ncols=True)
