"""Writes through `.data` of a sharded piece, told to whoever holds a copy of it (sharded_tensor.py asks)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["on_data_read", "data_read", "watches_data"]

_ON_DATA = "_sw_on_data_read"


def on_data_read(param: torch.Tensor, callback: Callable[[], None]) -> None:
    """Call `callback()` whenever `param.data` is read. `.data` is an alias with a version counter of its own, so a
    write through it (`p.data.mul_(0.5)`, `p.data.copy_(ema)`: an EMA swapped in for evaluation, weight clipping)
    leaves `param._version` as it was; the sharding engine, which tells a stale gathered copy by the version of its
    master, is told this way instead (its callback marks the unit stale: read, so possibly written)."""
    setattr(param, _ON_DATA, callback)


def data_read(t: Any) -> None:
    """`t.data` was read: call its callback, if it has one."""
    callback = getattr(t, _ON_DATA, None)
    if callback is not None:
        callback()


def watches_data(t: Any) -> bool:
    """Whether `t` has a `.data` callback (a shard parameter whose engine keeps a gathered copy)."""
    return getattr(t, _ON_DATA, None) is not None
