"""The timeline plot of an elastic run: loss and world size against time, epochs marked with why they began.

`plot_timeline(timeline, path)` draws what `sw.elastic.run` records in `ElasticRun.timeline` (one entry per
optimizer step: time, step, world size, loss; one per epoch: time, epoch, world size, the reason it began and where
its state came from). Time is in seconds from the first entry. The loss is drawn against the left axis, the world
size as a step line against the right one, and every epoch after the first as a vertical line labelled with its
world size and the source of its state ("resharded", "joined", "checkpoint", ...), so a reader sees the job lose a
worker, keep training on fewer, and grow again. matplotlib is needed (the `[bench]` extra).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

__all__ = ["plot_timeline"]


def plot_timeline(timeline: Sequence[dict[str, Any]], path: str | os.PathLike, *, title: str = "") -> None:
    """Write the PNG of `timeline` (an `ElasticRun.timeline`) to `path`. Raises ValueError on an empty timeline
    and ImportError naming the extra when matplotlib is missing."""
    if not timeline:
        raise ValueError("plot_timeline: the timeline is empty (run sw.elastic.run first)")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("plot_timeline needs matplotlib: pip install 'shardwise[bench]'") from exc
    t0 = timeline[0]["t"]
    steps = [e for e in timeline if "loss" in e]
    epochs = [e for e in timeline if "epoch" in e]
    fig, loss_ax = plt.subplots(figsize=(8, 4))
    losses = [(e["t"] - t0, e["loss"]) for e in steps if e["loss"] is not None]
    if losses:
        loss_ax.plot(*zip(*losses), "o-", color="tab:blue", markersize=3, label="loss")
    loss_ax.set_xlabel("time since the job started (s)")
    loss_ax.set_ylabel("training loss", color="tab:blue")
    world_ax = loss_ax.twinx()
    points = sorted((e["t"] - t0, e["world"]) for e in timeline if "world" in e)
    world_ax.step([t for t, _ in points], [w for _, w in points], where="post", color="tab:orange",
                  label="workers")
    world_ax.set_ylabel("workers", color="tab:orange")
    world_ax.set_ylim(0, max(w for _, w in points) + 1)
    for e in epochs[1:]:
        x = e["t"] - t0
        loss_ax.axvline(x, color="grey", linestyle="--", linewidth=0.8)
        loss_ax.annotate(f"epoch {e['epoch']}: {e['world']} workers ({e.get('source', '')})", (x, 1.0),
                         xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right", fontsize=7)
    loss_ax.set_title(title or "elastic run: loss and world size")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
