"""Cut a model given as a sequence of layers into contiguous pipeline stages.

`partition(layers, n_stages, balance=...)` accepts an nn.Sequential, an nn.ModuleList or a plain list of modules
(e.g. `GPT.pipeline_layers()`: the embedding, each block, the final norm + head). A layer maps one tensor to one
tensor, or takes and returns structures (a tuple is splatted into the next layer's positional arguments, a dict
into its keyword arguments; see `structure.py`), as an HF-style decoder layer does. It returns
`n_stages * virtual_stages` `Stage` modules; stage s runs on pipeline rank s % n_stages, so with `virtual_stages=v`
each rank holds v non-adjacent stages (Megatron-LM's interleaved placement).

Balancing picks the contiguous split that minimises the heaviest stage (the pipeline runs at the pace of its
slowest stage), by dynamic programming over the layer weights:

* ``"params"``: weight = parameters held by the layer (a parameter shared by two layers counts in both, since both
  stages hold a copy of it);
* ``"time"``: weight = the layer's measured forward time on `sample_input` (median of `repeats` runs);
* a list of cut points: stage k is ``layers[cuts[k-1]:cuts[k]]`` with ``cuts[-1] = 0`` and ``cuts[S-1] = len``
  implied, so S stages need S-1 strictly increasing cuts in 1..len-1.

The stages hold the given layer modules themselves (no copies): training a stage trains the original model.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .structure import call

__all__ = ["Stage", "partition"]


class Stage(nn.Sequential):
    """A contiguous run of layers: ``layers[start:stop]`` of the partitioned model, applied in order.

    `index` is the stage's position in the pipeline, `start`/`stop` the layer range it covers.
    """

    def __init__(self, layers: Sequence[nn.Module], index: int, start: int, stop: int) -> None:
        super().__init__(*layers)
        self.index = index
        self.start = start
        self.stop = stop

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The first layer called with the stage's arguments, each next layer with the previous one's output under
        the calling convention of `structure.py` (a tuple splatted, a dict as keywords, anything else as is)."""
        layers = iter(self)
        value = next(layers)(*args, **kwargs)
        for layer in layers:
            value = call(layer, value)
        return value

    def extra_repr(self) -> str:
        return f"index={self.index}, layers={self.start}..{self.stop - 1}"


def _as_layers(layers: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    if isinstance(layers, (nn.Sequential, nn.ModuleList)):
        out = list(layers)
    elif isinstance(layers, nn.Module):
        raise ValueError(
            f"partition: layers is a {type(layers).__name__}, not a sequence; pass an nn.Sequential, an nn.ModuleList "
            f"or a list of modules (for the GPT: model.pipeline_layers())"
        )
    else:
        out = list(layers)
    for i, layer in enumerate(out):
        if not isinstance(layer, nn.Module):
            raise ValueError(f"partition: layers[{i}] is a {type(layer).__name__}, not an nn.Module")
    return out


def _params_of(layer: nn.Module) -> int:
    return sum(p.numel() for p in layer.parameters())


@torch.no_grad()
def _forward_times(layers: list[nn.Module], sample_input: Any, repeats: int) -> list[float]:
    """Each layer's median forward time on the input the layers before it produce. A first, untimed pass makes the
    inputs and warms up; then `repeats` rounds time every layer once each, round-robin, so a burst of load on a
    busy machine slows one round of all layers alike instead of every run of one layer."""
    inputs, x = [], sample_input
    for layer in layers:
        inputs.append(x)
        x = call(layer, x)
    samples: list[list[float]] = [[] for _ in layers]
    for _ in range(repeats):
        for layer, x, mine in zip(layers, inputs, samples):
            t0 = time.perf_counter()
            call(layer, x)
            mine.append(time.perf_counter() - t0)
    return [statistics.median(mine) for mine in samples]


def _balanced_cuts(weights: list[float], n_parts: int) -> list[int]:
    """Cut points of the contiguous split of `weights` into n_parts non-empty runs minimising the largest sum."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: smallest possible heaviest part when the first i layers form k parts; cut[k][i] the last cut.
    best = [[inf] * (n + 1) for _ in range(n_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(n_parts + 1)]
    best[0][0] = 0.0
    for k in range(1, n_parts + 1):
        for i in range(k, n - (n_parts - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:  # strict: ties keep the earliest cut, so results are deterministic
                    best[k][i], cut[k][i] = cost, j
    cuts = []
    i = n
    for k in range(n_parts, 0, -1):
        i = cut[k][i]
        cuts.append(i)
    return sorted(cuts)[1:]  # drop the leading 0


def partition(
    layers: nn.Module | Sequence[nn.Module],
    n_stages: int,
    balance: str | Sequence[int] = "params",
    *,
    virtual_stages: int = 1,
    sample_input: Any = None,
    repeats: int = 3,
) -> list[Stage]:
    """Split `layers` into `n_stages * virtual_stages` contiguous Stages (see the module docstring).

    n_stages: pipeline ranks p. virtual_stages: stages per rank v (for schedule="interleaved_1f1b").
    balance: "params", "time" (needs `sample_input`, the first layer's input) or a list of cut points.
    Raises ValueError naming the argument when there are more stages than layers, the balance is unknown, or the
    cut points are not S-1 strictly increasing indices in 1..len(layers)-1.
    """
    mods = _as_layers(layers)
    for name, value in (("n_stages", n_stages), ("virtual_stages", virtual_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"partition: {name}={value!r} must be a positive int")
    total = n_stages * virtual_stages
    if total > len(mods):
        raise ValueError(
            f"partition: n_stages x virtual_stages = {n_stages} x {virtual_stages} = {total} stages but the model has "
            f"only {len(mods)} layers; every stage needs at least one layer"
        )
    if isinstance(balance, str):
        if balance == "params":
            cuts = _balanced_cuts([float(_params_of(m)) for m in mods], total)
        elif balance == "time":
            if sample_input is None:
                raise ValueError("partition: balance='time' needs sample_input, an input of the first layer")
            cuts = _balanced_cuts(_forward_times(mods, sample_input, max(1, repeats)), total)
        else:
            raise ValueError(f"partition: balance={balance!r} is not allowed; use 'params', 'time' or a list of cuts")
    else:
        cuts = list(balance)
        ok = (len(cuts) == total - 1 and all(isinstance(c, int) and not isinstance(c, bool) for c in cuts)
              and all(a < b for a, b in zip([0, *cuts], [*cuts, len(mods)])))
        if not ok:
            raise ValueError(
                f"partition: balance={list(balance)!r} must be {total - 1} strictly increasing cut points in "
                f"1..{len(mods) - 1} (stage k = layers[cuts[k-1]:cuts[k]]) for {total} stages of {len(mods)} layers"
            )
    bounds = [0, *cuts, len(mods)]
    return [Stage(mods[a:b], k, a, b) for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]
