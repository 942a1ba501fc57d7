"""Agreement at wrap time: the ranks that must hold the same model check that they do, with one small collective.

A data-parallel replica built from another model (same element count, layers in another order), tensor-parallel
ranks built with different weights, or ranks passing different options would otherwise train, silently, on
numbers that mean nothing. Each strategy describes what its group must agree on (parameter names, shapes, dtypes,
requires_grad; options; for tensor parallel a fingerprint of every dense weight taken before slicing), every rank
hashes its description, and the 8-byte digests are all-gathered: one collective of 8 x N bytes when all agree
(Horovod checks the same before training). Only when they differ are the descriptions themselves gathered (JSON,
never pickle), to name the first difference and the ranks. Wrapping is therefore collective: every rank of the
group must wrap, in the same order.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from torch import nn

from .comm.base import Communicator, ReduceOp
from .comm.objects import all_gather_json

__all__ = ["check_agreement", "describe_parameters", "fingerprints", "agree_on_recovery"]


_BUILD_ALIKE = "build the same model (same seed or state dict) with the same options on every rank"


def describe_parameters(module: nn.Module) -> list[list[Any]]:
    """[name, shape, dtype, requires_grad] for every parameter, in registration order (tied ones once)."""
    return [[name, list(p.shape), str(p.dtype).removeprefix("torch."), bool(p.requires_grad)]
            for name, p in module.named_parameters()]


@torch.no_grad()
def fingerprints(module: nn.Module) -> list[str]:
    """A cheap fingerprint of every parameter's values: its float64 sum and sum of squares (as exact hex floats).
    Equal weights give bit-equal fingerprints on every rank; differently seeded ones differ. A tensor-parallel slice
    is fingerprinted as the piece this rank holds (what ranks at the same tp coordinate must agree on)."""
    from .sharded_tensor import local  # sharded_tensor imports whole/, which imports this module

    out = []
    for p in module.parameters():
        values = local(p.detach()).double()
        out.append(f"{float(values.sum()).hex()}/{float(values.square().sum()).hex()}")
    return out


def _first_difference(a: Any, b: Any, path: str = "") -> tuple[str, Any, Any] | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            if key not in a or key not in b:
                return f"{path}.{key}".lstrip("."), a.get(key, "<absent>"), b.get(key, "<absent>")
            found = _first_difference(a[key], b[key], f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b)):
            found = _first_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        if len(a) != len(b):
            return f"{path} (length)".lstrip("."), len(a), len(b)
        return None
    return None if a == b else (path.lstrip("."), a, b)


def check_agreement(comm: Communicator, who: str, description: dict[str, Any], advice: str = _BUILD_ALIKE) -> None:
    """Raise ValueError naming the first difference, the ranks and `advice` unless every rank of `comm` passed an
    equal JSON-able `description` (see the module docstring). Collective over `comm`; free for a group of one."""
    if comm.size == 1:
        return
    text = json.dumps(description, sort_keys=True, separators=(",", ":"))
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)
    mine = torch.tensor([digest], dtype=torch.int64, device=comm.device)
    everyone = torch.empty(comm.size, dtype=torch.int64, device=comm.device)
    comm.all_gather(everyone, mine)
    if bool((everyone == everyone[0]).all()):
        return
    described = all_gather_json(comm, description)
    other = next(r for r in range(comm.size) if described[r] != described[0])
    where, first, second = _first_difference(described[0], described[other]) or ("(description)", "?", "?")
    group = list(getattr(comm, "global_ranks", range(comm.size)))
    raise ValueError(f"{who}: the ranks of its group disagree: {where} is {first!r} on rank {group[0]} but "
                     f"{second!r} on rank {group[other]}; {advice}")


def agree_on_recovery(comm: Communicator, who: str) -> None:
    """After a forward or backward that raised on this rank, check that every rank of `comm` is recovering too.

    A step that failed on every rank (a bad batch) is recoverable: every rank arrives here and this one-element
    all-reduce completes. A step that failed on this rank only is not: its peers are still inside that step's
    collectives, and letting this rank go on would pair its next collectives with their old ones (equal-sized
    all-reduces combine silently). Here the peers' pending collective meets this small one instead: a mismatch the
    backend reports, or a timeout, so every rank raises CommError rather than train on crossed gradients.
    """
    if comm.size == 1:
        return
    flag = torch.ones(1, device=comm.device)
    comm.all_reduce(flag, ReduceOp.SUM)
    if int(flag.item()) != comm.size:
        raise RuntimeError(f"{who}: {int(flag.item())} of {comm.size} ranks are recovering from a failed step; the "
                           f"others are not: the job cannot continue in step")
