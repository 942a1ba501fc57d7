"""Replicas that disagree are caught: `check_replicas(model)` compares a checksum of every replicated tensor across
the ranks holding copies of it, and raises naming the tensor and the ranks.

Why. A data-parallel strategy keeps copies of the same values on several ranks (DDP's whole parameters, the pieces a
hybrid-sharded model replicates over its replicate group, tensor parallel's LayerNorms on every tp rank). They stay
equal only as long as every rank applies the same update: a rank that skipped a step, a nondeterministic kernel, a
bit flip or a bug make them drift apart, and a checkpoint then saves one rank's copy as if it were everyone's
(issue 33). `sw.save_checkpoint` calls this first; call it yourself every N steps to catch drift earlier.

Mechanism: per tensor, two float64 numbers of this rank's copy (the sum of its values, and their sum weighted by
1 + (position mod 1009), so that a swap of two elements shows too), one all-gather per replica group of all the
tensors' checksums together, compared exactly (copies are bit-identical when the replicas agree: the same values
summed in the same order). Cost: one pass over the replicated tensors and one small all-gather per group.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import layout
from ..comm.base import Communicator
from ..placement import comm_device
from ..sharded_tensor import local

__all__ = ["ReplicaMismatch", "check_replicas"]


class ReplicaMismatch(RuntimeError):
    """Copies of a replicated tensor differ across the ranks that should hold the same values."""


def _checksum(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1).double()
    weights = 1.0 + (torch.arange(flat.numel(), device=flat.device) % 1009).double()
    return torch.stack([flat.sum(), (flat * weights).sum()])


def check_replicas(model: nn.Module) -> None:
    """Raise ReplicaMismatch naming every tensor whose copies differ, and the ranks that hold which value.
    Collective over every replica group of the model's strategies (every rank calls it)."""
    by_group: dict[int, tuple[Communicator, list[str], list[torch.Tensor]]] = {}
    for pl in layout.placements(model).values():
        for group in pl.replicated_over:
            if group.size < 2:
                continue
            entry = by_group.setdefault(id(group), (group, [], []))
            entry[1].append(pl.name)
            entry[2].append(_checksum(local(pl.param)))
    problems = []
    for group, names, sums in by_group.values():  # in order of first appearance: the same on every member
        mine = torch.stack(sums).to(comm_device(group)).reshape(-1)
        everyone = torch.empty(group.size * mine.numel(), dtype=mine.dtype, device=mine.device)
        group.all_gather(everyone, mine)
        everyone = everyone.cpu().view(group.size, len(names), 2)
        for i, name in enumerate(names):
            values = everyone[:, i]
            if not bool((values == values[0]).all()):
                ranks = list(getattr(group, "global_ranks", range(group.size)))
                groups: dict[tuple[float, float], list[int]] = {}
                for r, v in zip(ranks, values.tolist()):
                    groups.setdefault(tuple(v), []).append(r)
                problems.append(f"{name}: ranks {' / '.join(str(g) for g in groups.values())} hold different copies "
                                f"(checksums {', '.join(f'{k[0]:.9g}' for k in groups)})")
    if problems:
        raise ReplicaMismatch("replicas disagree: " + "; ".join(problems[:10]) + (
            f"; and {len(problems) - 10} more" if len(problems) > 10 else "") + ". Copies that should be equal have "
            "drifted apart (a rank that skipped a step, a nondeterministic kernel, a bug); a checkpoint would save "
            "one rank's copy as everyone's")
