"""Local SGD's synchronisations refuse values that are not finite, before they reach the anchors, the outer
optimizer's momentum or the other workers' parameters.

A worker whose inner step was taken with gradients that are not finite (no loss scaler skipped it) holds NaN or inf
parameters. Averaged, they would become every worker's anchors and DiLoCo's outer momentum, and no later step could
recover. The averaged result of a synchronisation is the same on every rank, so its check is too: every rank raises
NonFiniteStateError at the same synchronisation, naming the parameter (or buffer), before anything is written; the
outer state is as it was. Cost: one sum per averaged flat buffer and one host read per synchronisation (every H
steps). A step skipped by `sw.ShardedGradScaler` never reaches a synchronisation: the inner optimizer's step is not
taken, so it is not counted.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..compression.base import Compressor
from ..compression.transaction import NonFiniteStateError, count_nonfinite, first_nonfinite

__all__ = ["check_averaged"]


def _message(who: str, what: str, flat: torch.Tensor, members: Sequence[tuple[str, int]], at: str) -> str:
    """Name the first member of `flat` (consecutive (name, numel) pieces) holding a non-finite value."""
    offset = 0
    for name, numel in members:
        count = count_nonfinite(flat[offset:offset + numel])
        if count:
            return (f"{who}: the averaged {what} of {name!r} holds {count} non-finite values at {at}: a worker's "
                    f"parameters are not finite (a step whose gradients were not finite was taken; skip such steps "
                    f"with sw.ShardedGradScaler). Nothing was written: the anchors, the outer optimizer's state and "
                    f"the parameters are as they were")
        offset += numel
    return f"{who}: the averaged {what} holds non-finite values at {at}"


def check_averaged(who: str, what: list[str], flats: Sequence[torch.Tensor],
                   members: Sequence[Sequence[tuple[str, int]]], at: str,
                   compressor: Compressor | None = None) -> None:
    """Raise NonFiniteStateError naming the first piece of `flats` (flat k packs `members[k]`, described as
    `what[k]`: "outer gradient", "parameters", "buffers") holding inf or nan. With the `compressor` whose reduction
    produced them, its state is settled in the same host read (restored on failure)."""
    if compressor is not None:
        compressor.settle(True, [(flat, lambda count, k=k: _message(who, what[k], flats[k], members[k], at))
                                 for k, flat in enumerate(flats)])
        return
    bad = first_nonfinite(list(flats))
    if bad is not None:
        raise NonFiniteStateError(_message(who, what[bad[0]], flats[bad[0]], members[bad[0]], at))
