"""`redistribute`: rebuild the training state of a new world from the survivors' in-memory snapshots.

Mechanism (collective over the new world's Communicator; every rank calls it, a newcomer with no snapshot):
1. The ranks agree on the step: the newest commit every survivor still holds (each keeps its last two, so a survivor
   that committed step s just before a peer died and one that had not agree on s - 1; see state.py).
2. Every rank lists the pieces its snapshot of that step covers: (tensor name, global box), the names of
   checkpoint/pieces.py. Replicated state (DDP, ZeRO-1/2 parameters) is listed by every survivor with the same
   box; sharded state (ZeRO-3 parameters, ZeRO-1/2/3 optimizer moments) by the rank that held each flat range, and,
   with neighbour redundancy, by that rank's successor too. A tensor whose boxes do not cover its global shape was
   lost with the dead ranks: `redistribute` raises `StateLost` naming it, and the caller falls back to the last
   checkpoint (whose loader reshards onto any layout).
3. One tensor at a time, each distinct box is broadcast from the lowest rank holding it into a dense buffer, and
   each rank copies out the boxes its new placement holds (`write_held`): peak memory is one dense tensor beyond
   the model; the traffic is each tensor once to every rank (a broadcast per box), which a later slice can cut to
   the boxes each rank needs with point-to-point.
4. Optimizer hyperparameters, the LR scheduler's and the sampler's state come from the first survivor as JSON;
   the RNG state is the first survivor's too (replicas stay in step; a newcomer has none of its own).
Anchors: DeepSpeed's universal checkpoint (reshaping ZeRO state across world sizes, through files) and torchft's
live recovery from a peer (replicated state only). Here sharded state is resharded live, through the layout
contract, so every strategy that declares placements is covered.
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import torch
from torch import nn

from .. import layout
from ..comm.base import Communicator
from ..comm.objects import all_gather_json, broadcast_json
from ..placement import comm_device
from ..whole.gather import write_held
from .snapshot import Snapshot, optimizer_owners

__all__ = ["StateLost", "agree_step", "jsonable_state", "redistribute"]


class StateLost(RuntimeError):
    """The survivors' snapshots do not cover some tensor: it was held only by ranks that are gone."""

    def __init__(self, message: str, names: list[str]) -> None:
        super().__init__(message)
        self.names = names


def agree_step(comm: Communicator, committed: list[int]) -> int | None:
    """The newest step that every rank holding commits holds (`committed`: this rank's; a newcomer passes []).
    None when there is no survivor or no common step."""
    everyone = all_gather_json(comm, sorted(committed))
    holders = [set(steps) for steps in everyone if steps]
    if not holders:
        return None
    common = set.intersection(*holders)
    return max(common) if common else None


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def redistribute(comm: Communicator, snap: Snapshot | None, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 scheduler: Any = None, sampler: Any = None, *, backup: list[Any] | None = None) -> dict[str, Any]:
    """Fill `model` (wrapped on `comm`) and `optimizer` (built over it, no state yet) from the snapshots of the
    step every survivor holds (`snap`: this rank's snapshot of it, None on a newcomer; `backup`: the pieces of
    the neighbour's snapshot of the same step this rank keeps, with redundancy). Returns {"step", "source"}; raises StateLost."""
    pieces = [] if snap is None else list(snap.pieces())
    if backup:
        pieces += backup
    listing = {}
    for name, box, data, shape in pieces:
        listing.setdefault(name, {"shape": list(shape), "dtype": str(data.dtype).removeprefix("torch."), "boxes": []})
        key = [list(b) for b in box]
        if key not in listing[name]["boxes"]:
            listing[name]["boxes"].append(key)
    everyone = all_gather_json(comm, listing)
    holders: dict[str, dict[str, Any]] = {}
    for rank, mine in enumerate(everyone):
        for name, entry in mine.items():
            into = holders.setdefault(name, {"shape": entry["shape"], "dtype": entry["dtype"], "boxes": {}})
            for box in entry["boxes"]:
                into["boxes"].setdefault(tuple(tuple(b) for b in box), rank)  # the lowest rank holding it sends
    lost = sorted(name for name, e in holders.items()
                  if sum(layout.box_numel(b) for b in e["boxes"]) != math.prod(e["shape"]))
    wanted = [f"param/{pl.name}" for pl in layout.placements(model).values()]
    lost += [name for name in wanted if name not in holders]
    if lost:
        raise StateLost(f"elastic: the survivors' snapshots do not cover {len(lost)} tensor(s), held only by the ranks "
                        f"that left: {lost[:6]}; recover from a checkpoint (ElasticState(checkpoint_dir=...)) or "
                        f"keep a neighbour's copy (redundancy=True)", lost)
    local = {(name, tuple(tuple(b) for b in box)): data for name, box, data, _ in pieces}
    device = comm_device(comm)

    def dense(name: str) -> torch.Tensor:
        """The whole of tensor `name`, each box broadcast from its holder."""
        entry = holders[name]
        out = torch.empty(entry["shape"], dtype=_dtype(entry["dtype"]))
        for box, owner in sorted(entry["boxes"].items()):
            part = local[(name, box)] if comm.rank == owner else None
            buf = (part.detach().to(device).contiguous().clone() if part is not None else
                   torch.empty([n for _, n in box], dtype=out.dtype, device=device))
            comm.broadcast(buf, owner)
            out[layout.box_slices(box)] = buf.cpu()
        return out

    with torch.no_grad():
        placements = list(layout.placements(model).values())
        for pl in placements:
            write_held(pl, pl.param.detach(), dense(f"param/{pl.name}").to(pl.param.device, pl.param.dtype))
        for name, b in layout.buffers(model).items():
            if f"buffer/{name}" in holders:
                b.copy_(dense(f"buffer/{name}"))
        if optimizer is not None:
            _fill_optimizer(comm, model, optimizer, placements, holders, dense)
    first = next(r for r, mine in enumerate(everyone) if mine)
    small = broadcast_json(comm, None if comm.rank != first else {
        "sampler": snap.sampler, "scheduler": jsonable_state(snap.scheduler),
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in (snap.optimizer or {}).get("param_groups", [])],
        "step": snap.step}, src=first)
    if optimizer is not None and small["groups"]:
        if len(small["groups"]) != len(optimizer.param_groups):
            raise ValueError(f"elastic: the new optimizer has {len(optimizer.param_groups)} parameter groups, the "
                             f"survivors' had {len(small['groups'])}; build it the same way on every world")
        for group, saved in zip(optimizer.param_groups, small["groups"]):
            group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in saved.items()})
    if scheduler is not None and small["scheduler"] is not None:
        scheduler.load_state_dict(small["scheduler"])
    if sampler is not None and small["sampler"] is not None:
        sampler.load_state_dict(small["sampler"])
    rng = torch.get_rng_state() if comm.rank == first else torch.empty_like(torch.get_rng_state())
    rng = rng.to(device)
    comm.broadcast(rng, first)
    torch.set_rng_state(rng.cpu())
    return {"step": small["step"], "source": "survivors"}


def _fill_optimizer(comm: Communicator, model: nn.Module, optimizer: torch.optim.Optimizer,
                    placements: list[layout.Placement], holders: dict[str, Any], dense: Any) -> None:
    """Give every parameter of `optimizer` the survivors' state for it: moments resharded onto the new placement,
    scalars (Adam's step) copied whole. Tensor names are visited in the same order on every rank."""
    owners = optimizer_owners(model, optimizer, placements)
    by_param = {}
    for name in sorted(holders):
        if name.startswith("optim/"):
            param_name, key = name[len("optim/"):].rsplit("/", 1)
            by_param.setdefault(param_name, []).append((key, name))
    index_of = {placements[pos].name: idx for idx, pos in owners.items()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for pl in placements:
        for key, name in by_param.get(pl.name, []):
            whole = dense(name)
            if pl.name not in index_of:
                continue  # a parameter this optimizer does not train (still took part in the broadcast)
            p = params[index_of[pl.name]]
            state = optimizer.state[p]
            if tuple(whole.shape) == tuple(pl.shape) and whole.dim() > 0:
                target = torch.zeros_like(p, dtype=whole.dtype)
                write_held(pl, target, whole.to(p.device))
                state[key] = target
            else:  # a scalar (Adam's step): where the optimizer keeps it, on the host
                state[key] = whole


def jsonable_state(value: Any) -> Any:
    """A scheduler state as JSON (lists for tuples); non-JSON entries (lambdas) dropped, as torch's own does."""
    if value is None:
        return None
    out = copy.deepcopy(value)
    return {k: v for k, v in out.items() if _is_json(v)}


def _is_json(v: Any) -> bool:
    try:
        json.dumps(v)
        return True
    except TypeError:
        return False
