"""Straggler simulation: make one rank `factor` times slower by sleeping in proportion to its compute time.

    slow = Straggler(factor=3.0 if rank == 1 else 1.0)
    with slow:                      # times the block, then sleeps (factor - 1) x its duration
        model(x, y).backward()

    rotating = RotatingStraggler(3.0, worker=rank, n_workers=4)   # each worker in turn is the slow one
    for k in range(steps):
        with rotating.step(k):
            model(x, y).backward()

Sleeping (rather than spinning) models a slower machine without taking CPU from the others: on a shared, loaded
host the other ranks keep their speed, which is what a benchmark of asynchrony needs. `slept` and `computed` keep
the totals (seconds).

`Straggler` is a persistent straggler (one slower machine). `RotatingStraggler` is a transient one, what Stale
Synchronous Parallel (Ho et al. 2013) is for: at every step one of the n workers is `factor` times slower, each in
turn for `every` of its steps. Its pause is (factor - 1) x the worker's own full-speed step time, calibrated as the
median of its first `calibration_steps` steps (which are never slowed): timing each slowed step against the current
one would count, in a synchronous run, the wait for the previous straggler inside the all-reduce, and each pause
would grow longer than the last.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from .checks import check_positive_int

__all__ = ["RotatingStraggler", "Straggler"]


def check_factor(owner: str, factor: float) -> float:
    """`factor` as a float, or ValueError naming `owner`: a slowdown is a number >= 1."""
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 1:
        raise ValueError(f"{owner}: factor={factor!r} must be a number >= 1 (1 = full speed, 3 = three times slower)")
    return float(factor)


class Straggler:
    """A context manager adding (factor - 1) x the block's duration of sleep after it (factor 1: no-op)."""

    def __init__(self, factor: float = 1.0) -> None:
        self.factor = check_factor("Straggler", factor)
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


class RotatingStraggler:
    """Each of `n_workers` workers in turn `factor` x slower for `every` steps; this object is worker `worker`'s.

    `step(k)` wraps the k-th step's compute: the first `calibration_steps` run at full speed and are timed; from then
    on the steps where this worker is the slow one ((k - calibration_steps) // every cycles over the workers) are
    followed by a pause of (factor - 1) x the calibrated median step time.
    """

    def __init__(self, factor: float, worker: int, n_workers: int, every: int = 1, calibration_steps: int = 5) -> None:
        factor = check_factor("RotatingStraggler", factor)
        for name, value in (("n_workers", n_workers), ("every", every), ("calibration_steps", calibration_steps)):
            check_positive_int(value, name, "RotatingStraggler")
        if isinstance(worker, bool) or not isinstance(worker, int) or not 0 <= worker < n_workers:
            raise ValueError(f"RotatingStraggler: worker={worker!r} must be an int in [0, {n_workers})")
        self.factor, self.worker, self.n_workers = factor, worker, n_workers
        self.every, self.calibration_steps = every, calibration_steps
        self.durations: list[float] = []  # the calibration steps' durations
        self.baseline: float | None = None  # their median, once taken
        self.slept = 0.0
        self.computed = 0.0

    def is_slow(self, k: int) -> bool:
        """Whether step `k` of this worker is a slowed one."""
        if k < self.calibration_steps or self.factor == 1:
            return False
        return ((k - self.calibration_steps) // self.every) % self.n_workers == self.worker

    @contextlib.contextmanager
    def step(self, k: int) -> Iterator[None]:
        start = time.perf_counter()
        yield
        elapsed = time.perf_counter() - start
        self.computed += elapsed
        if k < self.calibration_steps:
            self.durations.append(elapsed)
            return
        if self.baseline is None:
            ordered = sorted(self.durations)
            self.baseline = ordered[len(ordered) // 2] if ordered else 0.0
        if self.is_slow(k):
            pause = (self.factor - 1) * self.baseline
            time.sleep(pause)
            self.slept += pause
