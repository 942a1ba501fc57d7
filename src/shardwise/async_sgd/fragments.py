"""Streaming DiLoCo's fragments: the model's layer blocks split into F groups that synchronise at different steps.

A *block* is the unit a fragment is made of: the prefix of a parameter's name up to its first numeric component
(`blocks.3.attn.qkv.weight` -> `blocks.3`, one transformer block of a `ModuleList`), or, for a parameter outside
any list, its top-level module (`tok_emb.weight` -> `tok_emb`). Blocks keep the order of `named_parameters()`.

Two patterns, as in Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512, Section 2.2 and its Figure 3):
* "sequential": fragment f is a run of consecutive blocks; the cuts are placed so the fragments carry about equal
  bytes (the point of streaming is a peak bandwidth of ~1/F of the model's);
* "strided": block i goes to fragment i % F (layers 0, F, 2F, ... together), which the paper reports as slightly
  better; the fragments' bytes are then whatever the strides give.

Pure logic, no ranks: `split_fragments(names, sizes, F, pattern)` returns F lists of parameter indices.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["block_of", "split_fragments", "PATTERNS"]

PATTERNS = ("sequential", "strided")


def block_of(name: str) -> str:
    """The block a parameter (or buffer) named `name` belongs to (see the module docstring)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0] if len(parts) > 1 else name


def split_fragments(names: Sequence[str], sizes: Sequence[int], fragments: int,
                    pattern: str = "sequential") -> list[list[int]]:
    """Split the parameters `names` (with their byte `sizes`) into `fragments` groups of whole blocks.

    ValueError when `fragments` exceeds the number of blocks (a fragment would be empty) or the pattern is unknown.
    """
    if pattern not in PATTERNS:
        raise ValueError(f"StreamingDiLoCo: pattern={pattern!r}; allowed: {', '.join(map(repr, PATTERNS))}")
    blocks: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        blocks.setdefault(block_of(name), []).append(i)
    units = list(blocks.values())
    if fragments > len(units):
        raise ValueError(f"StreamingDiLoCo: fragments={fragments} but the model has {len(units)} layer blocks "
                         f"({', '.join(list(blocks)[:8])}{', ...' if len(units) > 8 else ''}); allowed: 1 to "
                         f"{len(units)}")
    if pattern == "strided":
        out: list[list[int]] = [[] for _ in range(fragments)]
        for u, unit in enumerate(units):
            out[u % fragments].extend(unit)
        return [sorted(f) for f in out]
    # Sequential: cut after the block whose cumulative bytes first reach k/F of the total, while leaving at least
    # one block for every later fragment.
    unit_bytes = [sum(sizes[i] for i in unit) for unit in units]
    total = sum(unit_bytes)
    out = []
    start, acc = 0, 0
    for f in range(fragments - 1):
        goal = total * (f + 1) / fragments
        end = start + 1  # at least one block
        acc += unit_bytes[start]
        last_allowed = len(units) - (fragments - 1 - f)  # blocks [end, last_allowed) may still join fragment f
        while end < last_allowed and abs(acc + unit_bytes[end] - goal) < abs(acc - goal):
            acc += unit_bytes[end]
            end += 1
        out.append([i for unit in units[start:end] for i in unit])
        start = end
    out.append([i for unit in units[start:] for i in unit])
    return out
