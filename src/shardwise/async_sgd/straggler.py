"""Straggler simulation: make one rank `factor` times slower by sleeping in proportion to its compute time.

    slow = Straggler(factor=3.0 if rank == 1 else 1.0)
    with slow:                      # times the block, then sleeps (factor - 1) x its duration
        model(x, y).backward()

Sleeping (rather than spinning) models a slower machine without taking CPU from the others: on a shared, loaded
host the other ranks keep their speed, which is what a benchmark of asynchrony needs. `slept` and `computed` keep
the totals (seconds).
"""

from __future__ import annotations

import time

__all__ = ["Straggler"]


class Straggler:
    """A context manager adding (factor - 1) x the block's duration of sleep after it (factor 1: no-op)."""

    def __init__(self, factor: float = 1.0) -> None:
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 1:
            raise ValueError(f"Straggler: factor={factor!r} must be a number >= 1 (1 = full speed, 3 = three times "
                             f"slower)")
        self.factor = float(factor)
        self.slept = 0.0
        self.computed = 0.0
        self._start = 0.0

    def __enter__(self) -> Straggler:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        elapsed = time.perf_counter() - self._start
        self.computed += elapsed
        if self.factor > 1:
            pause = (self.factor - 1) * elapsed
            time.sleep(pause)
            self.slept += pause
