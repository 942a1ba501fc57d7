"""Structured values between pipeline stages: a tensor, a tuple/list of leaves, or a dict of str -> leaf.

An HF-style decoder layer takes more than one tensor (hidden states, an attention mask, position ids), so a stage
may take and return a *structure*: a single value, a tuple or list of leaves, or a dict whose keys are strings.
A *leaf* is a tensor, None, or any other object. One level of nesting is supported: a tuple inside a dict is a leaf
like any other object (passed along within a rank, but it cannot be sent to another rank).

Calling convention, the same between the layers of a `Stage` and between stages: a tuple or list is splatted as
positional arguments ``f(*value)``, a dict as keyword arguments ``f(**value)``, anything else is passed as the
single argument ``f(value)``. So what stage s returns is exactly what stage s+1 receives.

`flatten` / `unflatten` turn a structure into (container, keys, leaves) and back (tuples, lists and dicts are
rebuilt as plain tuples, lists and dicts); `split` cuts every tensor leaf of a batch into microbatches along dim 0;
`concat` joins per-microbatch outputs leaf by leaf.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["SINGLE", "TUPLE", "LIST", "DICT", "call", "flatten", "unflatten", "key_text", "split", "concat"]

# Container codes, also used on the wire (messages.py): keep them small non-negative ints.
SINGLE, TUPLE, LIST, DICT = 0, 1, 2, 3


def call(fn: Callable[..., Any], value: Any) -> Any:
    """`fn` applied to `value` under the calling convention of the module docstring."""
    if isinstance(value, (tuple, list)):
        return fn(*value)
    if isinstance(value, dict):
        return fn(**value)
    return fn(value)


def flatten(value: Any) -> tuple[int, tuple[int | str, ...], list[Any]]:
    """(container code, keys, leaves): keys are positions for tuples and lists, the dict's keys for a dict, and
    (0,) for a single value. A dict key that is not a string is a ValueError (it could not be a keyword argument)."""
    if isinstance(value, (tuple, list)):
        return (TUPLE if isinstance(value, tuple) else LIST), tuple(range(len(value))), list(value)
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise ValueError(f"Pipeline: dict keys passed between stages must be strings (keyword arguments), got "
                             f"{bad[0]!r}")
        return DICT, tuple(value), list(value.values())
    return SINGLE, (0,), [value]


def unflatten(container: int, keys: tuple[int | str, ...], leaves: list[Any]) -> Any:
    """The inverse of `flatten`."""
    if container == SINGLE:
        return leaves[0]
    if container == DICT:
        return dict(zip(keys, leaves))
    return tuple(leaves) if container == TUPLE else list(leaves)


def key_text(container: int, key: int | str) -> str:
    """How a leaf is named in messages: '' for a single value, '[1]' or "['mask']" otherwise."""
    return "" if container == SINGLE else f"[{key!r}]"


def split(where: str, name: str, value: Any, m: int) -> list[Any]:
    """`value` cut into m microbatches: every tensor leaf along dim 0 (equal parts), other leaves given to every
    microbatch unchanged. Raises ValueError naming `name` and the leaf when a tensor has no dim 0 that m divides."""
    container, keys, leaves = flatten(value)
    if container == SINGLE and not isinstance(value, torch.Tensor):
        raise ValueError(f"{where}: {name} must be a tensor with a batch dimension, or a tuple, list or dict of "
                         f"tensors, got {value!r}")
    if not any(isinstance(t, torch.Tensor) for t in leaves):
        raise ValueError(f"{where}: {name} has no tensor to cut into microbatches, got {value!r}")
    parts: list[list[Any]] = []
    for key, leaf in zip(keys, leaves):
        label = name + key_text(container, key)
        if not isinstance(leaf, torch.Tensor):
            parts.append([leaf] * m)
            continue
        if leaf.dim() == 0:
            raise ValueError(f"{where}: {label} must be a tensor with a batch dimension, got {leaf!r}")
        if leaf.shape[0] % m:
            raise ValueError(
                f"{where}: {label} has a batch of {leaf.shape[0]} rows (dim 0), which does not split into "
                f"n_microbatches={m} equal microbatches; use a batch size that is a multiple of {m}"
            )
        parts.append(list(leaf.chunk(m)))
    return [unflatten(container, keys, [p[mb] for p in parts]) for mb in range(m)]


def concat(where: str, values: list[Any]) -> Any:
    """Per-microbatch values joined leaf by leaf: tensors concatenated along dim 0, other leaves taken from the
    first microbatch. Raises ValueError for a 0-dim tensor leaf (it has no dim 0 to join along)."""
    container, keys, _ = flatten(values[0])
    columns = list(zip(*(flatten(v)[2] for v in values)))
    joined = []
    for key, column in zip(keys, columns):
        if not isinstance(column[0], torch.Tensor):
            joined.append(column[0])
            continue
        if column[0].dim() == 0:
            raise ValueError(f"Pipeline: {where} output{key_text(container, key)} is a 0-dim tensor, which cannot be "
                             f"concatenated over microbatches along dim 0; return it with a batch dimension")
        joined.append(torch.cat(column))
    return unflatten(container, keys, joined)
