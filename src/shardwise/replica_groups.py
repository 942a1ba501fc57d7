"""The replica group of a parameter under data parallel: over which ranks its gradient is averaged.

A data-parallel strategy over a group `comm` averages a parameter's gradient over the ranks holding the same values:
all of `comm` for a whole parameter or one split across `comm` as tensor parallel splits it; for a parameter split
over ranks *of* `comm` (MoE experts over an expert-parallel group borrowing dp's ranks, DeepSpeed-MoE's expert data
parallel, Rajbhandari et al. 2022, arXiv 2201.05596), the replica group its placement declares inside `comm`.
"""

from __future__ import annotations

from .comm.base import Communicator
from .layout import Placement

__all__ = ["data_parallel_group"]


def data_parallel_group(pl: Placement, comm: Communicator) -> Communicator | None:
    """The ranks of `comm` over which a data-parallel strategy on `comm` averages `pl`'s gradient: `comm` itself for a
    parameter every rank of `comm` holds alike (whole, or split across `comm` as tensor parallel is); for one split
    over ranks *of* `comm` (MoE experts over an expert-parallel group borrowing dp's ranks), the replica group it
    declares inside `comm` (expert data parallel), or None when no other rank holds its piece. ValueError when the
    two groups do not tile `comm` (a copy the average would miss)."""
    split = pl.box_group
    inside = set(comm.global_ranks)
    if split is None or split.size == 1 or len(inside & set(split.global_ranks)) <= 1:
        return comm
    replicas = [g for g in pl.replicated_over if g.size > 1 and set(g.global_ranks) <= inside]
    group = replicas[0] if replicas else None
    if not set(split.global_ranks) <= inside or split.size * (group.size if group else 1) != comm.size:
        raise ValueError(f"{pl.name} is split over {split.size} ranks of the data-parallel group ({comm.size} ranks) "
                         f"and replicated over {group.size if group else 1} of them: the two must tile the group (a "
                         f"MoE model's expert-parallel dp group must be the one data parallel runs over)")
    return group
