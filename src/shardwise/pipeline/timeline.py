"""Timelines of pipeline steps, simulated or measured, their bubble, and a Gantt picture of them.

A `Timeline` is a list of `Event`s (rank, action text, start, end): the simulator makes one from a cost model and
the executor records one from the clock (`Pipeline(..., record_timeline=True)`; every rank records its own events;
`Timeline.merge` joins the ranks' timelines). Processes on one machine share the monotonic clock
(`time.perf_counter`), so measured events of different ranks line up.

The bubble is the idle fraction of the ranks' time over the step: ``1 - sum(busy) / (p * makespan)``, where the
makespan runs from the first start to the last end over all ranks. With unit costs this is GPipe's
(p-1)/(m+p-1); the simulator computes it from exact sums so those textbook values come out exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["Event", "Timeline"]

_COLOURS = {"F": "#4c72b0", "B": "#55a868", "I": "#8fbf6a", "W": "#dd8452"}


@dataclasses.dataclass(frozen=True)
class Event:
    """One compute action on one rank: `action` is its text (e.g. ``"1F3"``), start/end in seconds or cost units."""

    rank: int
    action: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def stage(self) -> int:
        """The stage index (the digits before the op letter)."""
        digits = ""
        for c in self.action:
            if not c.isdigit():
                break
            digits += c
        return int(digits) if digits else 0

    @property
    def op(self) -> str:
        """The op letter (F, B, I or W)."""
        return "".join(c for c in self.action if c.isalpha())


class Timeline:
    """Events of `n_ranks` ranks over one step (see the module docstring)."""

    def __init__(self, events: Iterable[Event], n_ranks: int | None = None) -> None:
        self.events: list[Event] = sorted(events, key=lambda e: (e.rank, e.start, e.end))
        seen = max((e.rank for e in self.events), default=-1) + 1
        self.n_ranks = seen if n_ranks is None else n_ranks
        if self.n_ranks < seen:
            raise ValueError(f"Timeline: an event is on rank {seen - 1} but n_ranks={n_ranks}")

    @classmethod
    def merge(cls, timelines: Sequence[Timeline]) -> Timeline:
        """One timeline of every rank's events (e.g. the per-rank timelines the executor recorded)."""
        return cls([e for t in timelines for e in t.events])

    def of_rank(self, rank: int) -> list[Event]:
        return [e for e in self.events if e.rank == rank]

    @property
    def start(self) -> float:
        return min((e.start for e in self.events), default=0.0)

    @property
    def end(self) -> float:
        return max((e.end for e in self.events), default=0.0)

    @property
    def makespan(self) -> float:
        return self.end - self.start

    def busy(self, rank: int) -> float:
        return sum(e.duration for e in self.events if e.rank == rank)

    @property
    def idle(self) -> float:
        """Total idle time over all ranks within the makespan."""
        return self.n_ranks * self.makespan - sum(e.duration for e in self.events)

    @property
    def bubble(self) -> float:
        """Idle fraction: idle / (n_ranks * makespan); 0.0 for an empty timeline."""
        total = self.n_ranks * self.makespan
        return self.idle / total if total > 0 else 0.0

    def shifted(self, offset: float) -> Timeline:
        """The same events with `offset` subtracted from every time (e.g. to start at 0)."""
        moved = [dataclasses.replace(e, start=e.start - offset, end=e.end - offset) for e in self.events]
        return Timeline(moved, self.n_ranks)

    def plot(self, path: str | Path, *, title: str | None = None, unit: str = "time") -> Path:
        """Draw the timeline as a Gantt chart (one row per rank, rank 0 on top) into the PNG at `path`.

        Needs matplotlib (the `bench` extra). Colours: F blue, B green, I light green, W orange; bars of a rank's
        second and later (interleaved) stages are hatched; each bar is labelled with its microbatch when there is
        room.
        """
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch

        t0 = self.start
        width = max(self.makespan, 1e-12)
        per_rank = len(self.events) / max(self.n_ranks, 1)
        fig, ax = plt.subplots(figsize=(min(26, 6 + 0.35 * per_rank), 1.2 + 0.45 * self.n_ranks))
        for e in self.events:
            y = self.n_ranks - 1 - e.rank
            later_chunk = e.stage >= self.n_ranks  # interleaved: hatch the rank's second and later stages
            ax.broken_barh([(e.start - t0, e.duration)], (y + 0.1, 0.8), facecolors=_COLOURS.get(e.op, "#999999"),
                           edgecolors="white", linewidth=0.5, hatch="///" if later_chunk else None)
            if e.duration / width > 0.012:
                label = e.action.split(e.op)[-1]
                ax.text(e.start - t0 + e.duration / 2, y + 0.5, label, ha="center", va="center", fontsize=7,
                        color="white")
        ax.set_yticks([self.n_ranks - 1 - r + 0.5 for r in range(self.n_ranks)])
        ax.set_yticklabels([f"rank {r}" for r in range(self.n_ranks)])
        ax.set_xlim(0, width)
        ax.set_xlabel(unit)
        ax.set_title(title or f"bubble {self.bubble:.1%}")
        used = sorted({e.op for e in self.events}, key="FBIW".find)
        names = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "backward (weight)"}
        ax.legend(handles=[Patch(color=_COLOURS[o], label=names[o]) for o in used if o in names],
                  loc="center left", bbox_to_anchor=(1.005, 0.5), fontsize=8, frameon=False)
        fig.tight_layout()
        out = Path(path)
        fig.savefig(out, dpi=110)
        plt.close(fig)
        return out
