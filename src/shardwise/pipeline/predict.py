"""The end of `Pipeline.predict`: the last stage's output, delivered to every rank or to one.

`Pipeline.predict` runs the forward-only schedule (`schedules.py`) under ``torch.no_grad()`` and concatenates the
last stage's per-microbatch outputs along dim 0 on the last stage's rank (`structure.concat`). `deliver` then
hands the result over:

* ``to="all"``: broadcasts from the last stage's rank: first the output's structure as metadata (`messages.py`:
  a 10-word header, then a body for anything but a single tensor), from which the other ranks allocate buffers,
  then one broadcast per tensor leaf. If the output cannot be made or sent (a leaf that is neither a tensor nor
  None, a 0-dim tensor that cannot be concatenated), the last stage's rank sends an error header instead and every
  receiving rank raises ValueError too, rather than waiting for a timeout.
* ``to=r``: the same messages, point to point from the last stage's rank to rank r (nothing to send when r is the
  last stage's rank). The other ranks return None at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..comm.base import Communicator
from .messages import WORDS, body_length, decode, encode, spec_of
from .structure import flatten, unflatten

__all__ = ["check_destination", "deliver"]

_ERROR = -1000  # first word of a header announcing that the output cannot be sent
_HEADER, _BODY, _LEAF = 0, 1, 2


def check_destination(to: object, size: int) -> int | None:
    """None for ``to="all"``, else `to` checked to be a rank of the pipeline communicator (ValueError otherwise)."""
    if isinstance(to, str) and to == "all":
        return None
    if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to < size:
        raise ValueError(f"Pipeline.predict: to={to!r} must be 'all' or a rank of the pipeline communicator, one of "
                         f"0..{size - 1}")
    return to


def _failed(header: torch.Tensor, src: int) -> ValueError | None:
    if int(header[0]) != _ERROR:
        return None
    return ValueError(f"Pipeline.predict: the last stage's output cannot be sent from rank {src}; see the error "
                      f"raised there")


def deliver(comm: Communicator, produce: Callable[[], Any], src: int, dst: int | None,
            tag: Callable[[int, int], int]) -> Any:
    """The value that `produce()` makes on rank `src`, on every rank (dst None) or on rank `dst` only (None
    elsewhere). A ValueError of `produce` or of the encoding on `src` is raised on every receiving rank too.

    `tag(kind, leaf)` gives the point-to-point tags (kind: header, body, leaf) for a single destination.
    """
    if dst is None and comm.size == 1 or dst == src:
        return produce() if comm.rank == src else None
    if dst is not None and comm.rank not in (src, dst):
        return None

    def move(t: torch.Tensor, kind: int, leaf: int = 0) -> None:
        if dst is None:
            comm.broadcast(t, src=src)
        elif comm.rank == src:
            comm.send(t, dst, tag(kind, leaf))
        else:
            comm.recv(t, src, tag(kind, leaf))

    if comm.rank == src:
        try:
            value = produce()
            messages = encode(spec_of(value), "the last stage", comm.device)
        except ValueError:
            move(torch.tensor([_ERROR] + [0] * (WORDS - 1), dtype=torch.int64, device=comm.device), _HEADER)
            raise
        for kind, t in zip((_HEADER, _BODY), messages):
            move(t, kind)
        leaves = flatten(value)[2]
        for i in spec_of(value).tensor_indices:
            move(leaves[i].contiguous(), _LEAF, i)
        return value if dst is None else None
    header = torch.zeros(WORDS, dtype=torch.int64, device=comm.device)
    move(header, _HEADER)
    if (error := _failed(header, src)) is not None:
        raise error
    body = None
    if n := body_length(header):
        body = torch.zeros(n, dtype=torch.int64, device=comm.device)
        move(body, _BODY)
    spec = decode(header, body)
    leaves: list[Any] = [None] * len(spec.leaves)
    for i in spec.tensor_indices:
        leaves[i] = torch.empty(spec.leaves[i].shape, dtype=spec.leaves[i].dtype, device=comm.device)
        move(leaves[i], _LEAF, i)
    return unflatten(spec.container, spec.keys, leaves)
