"""`Snapshot`: an in-memory copy of one rank's training state at a committed step, in layout terms.

Mechanism. `capture` clones what this rank holds, and nothing more: every trained tensor (`Placement.param`: the full
parameter under DDP, the flat shard under ZeRO-3), every buffer, the optimizer's `state_dict()` (its tensors cloned:
under ZeRO-1/2/3 that is this rank's shard of the moments), the optimizer's hyperparameters, the LR scheduler's and
the sampler's state and the RNG states. A copy costs this rank's own model-state bytes once more in host or device
memory (Horovod's `state.commit()` costs the same; torchft keeps none and asks a live peer instead).

Two uses. On the same world, `restore` copies the clones back (rollback to the last commit: the step in progress
when a peer failed is discarded and redone). On a new world the placements kept beside the clones say which global
box of which tensor each clone covers (`layout.held_views`): `pieces()` lists them as (name, box, tensor), which is
what `reshard.redistribute` needs to rebuild any other layout from the survivors' snapshots, as a sharded
checkpoint does from its files (checkpoint/pieces.py names tensors the same way: param/<name>, optim/<name>/<key>,
buffer/<name>).
"""

from __future__ import annotations

import copy
import dataclasses
import random
from typing import Any

import numpy as np
import torch
from torch import nn

from .. import layout
from ..dropout_stream import restore_positions, stream_positions
from ..sharded_tensor import local
from ..whole.optim_state import follows_param, local_state_dict

__all__ = ["Snapshot", "capture"]


@dataclasses.dataclass
class Snapshot:
    """One rank's state at `step` (see the module docstring). `pieces()` names what it covers of the global model."""

    step: int
    placements: list[layout.Placement]  # in model order, as they were at capture (their boxes and flat ranges)
    params: list[torch.Tensor]  # clones of each placement's trained tensor
    buffers: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None  # optimizer.state_dict() with its tensors cloned
    owner_of_index: dict[int, int]  # optimizer param index -> position in `placements`
    scheduler: dict[str, Any] | None
    sampler: dict[str, Any] | None
    rng: tuple[torch.Tensor, Any, Any, dict[str, Any]]  # torch's, Python's, NumPy's, the dropout streams' positions
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def nbytes(self) -> int:
        """Bytes of tensors this snapshot holds (its memory cost)."""
        total = sum(t.numel() * t.element_size() for t in self.params)
        total += sum(t.numel() * t.element_size() for t in self.buffers.values())
        for state in (self.optimizer or {}).get("state", {}).values():
            total += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
        return total

    def pieces(self) -> list[tuple[str, layout.Box, torch.Tensor, tuple[int, ...]]]:
        """(tensor name, global box, box-shaped data, global shape) of everything this snapshot covers."""
        out = []
        for pl, saved in zip(self.placements, self.params):
            out += [(f"param/{pl.name}", box, view, tuple(pl.shape)) for box, view in layout.held_views(pl, saved)]
        for name, b in self.buffers.items():
            out.append((f"buffer/{name}", layout.full_box(b.shape), b, tuple(b.shape)))
        for index, state in (self.optimizer or {}).get("state", {}).items():
            pl = self.placements[self.owner_of_index[int(index)]]
            for key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    continue
                name = f"optim/{pl.name}/{key}"
                if follows_param(value, pl.param):
                    out += [(name, box, view, tuple(pl.shape)) for box, view in layout.held_views(pl, value)]
                else:  # a replicated scalar such as Adam's step
                    out.append((name, layout.full_box(value.shape), value, tuple(value.shape)))
        return out


def _rng(model: nn.Module) -> tuple[torch.Tensor, Any, Any, dict[str, Any]]:
    return torch.get_rng_state(), random.getstate(), np.random.get_state(), stream_positions(model)


def optimizer_owners(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                     placements: list[layout.Placement]) -> dict[int, int]:
    """optimizer.state_dict() parameter index -> position in `placements` (state_dict numbers the parameters of
    its groups in order)."""
    if optimizer is None:
        return {}
    position = {id(pl.param): i for i, pl in enumerate(placements)}
    owners, index = {}, 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in position:
                raise ValueError("ElasticState: the optimizer holds a tensor that is not a parameter of the wrapped "
                                 "model; build the optimizer over model.parameters() after wrapping")
            owners[index] = position[id(p)]
            index += 1
    return owners


@torch.no_grad()
def capture(step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any, sampler: Any,
            extra: dict[str, Any] | None = None) -> Snapshot:
    """Clone this rank's state (see the module docstring). No communication."""
    live = list(layout.placements(model).values())
    params = [pl.param.detach().clone() for pl in live]
    # The commit keeps each placement's geometry, not its live parameter: a parameter carries the strategy's hooks,
    # which hold the works of a failed step, and through them the failed process group, whose sockets must close
    # when the membership layer frees it (comm/membership.py). Its groups go too (held_views needs the geometry only):
    # a Communicator may hold sub-groups of the old world (a ZeRO engine's gloo ring), which would keep them open.
    placements = [dataclasses.replace(pl, param=torch.empty_like(pl.param, device="meta"), box_group=None,
                                      flat_group=None, replicated_over=(), partial_grad_over=None, tied_over=None)
                  for pl in live]
    buffers = {name: b.detach().clone() for name, b in layout.buffers(model).items()}
    opt_state = None
    if optimizer is not None:
        with local_state_dict():  # this rank's pieces: the snapshot restores this very layout
            opt_state = copy.deepcopy(optimizer.state_dict())  # deepcopy clones the tensors
    return Snapshot(step=step, placements=placements, params=params, buffers=buffers, optimizer=opt_state,
                    owner_of_index=optimizer_owners(model, optimizer, live),
                    scheduler=None if scheduler is None else copy.deepcopy(scheduler.state_dict()),
                    sampler=None if sampler is None else sampler.state_dict(), rng=_rng(model),
                    extra=copy.deepcopy(extra or {}))


@torch.no_grad()
def restore(snap: Snapshot, model: nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any,
            sampler: Any) -> None:
    """Copy `snap` back into the same (unchanged) model, optimizer, scheduler, sampler and RNGs."""
    placements = list(layout.placements(model).values())
    if [local(pl.param).shape for pl in placements] != [local(t).shape for t in snap.params]:
        raise ValueError("ElasticState.rollback: the model's layout changed since the commit (a new world?); "
                         "use ElasticState.resize with the rewrapped model instead")
    for pl, saved in zip(placements, snap.params):
        local(pl.param).detach().copy_(local(saved))
        pl.param.grad = None
    for name, b in layout.buffers(model).items():
        b.copy_(snap.buffers[name])
    if optimizer is not None and snap.optimizer is not None:
        with local_state_dict():
            optimizer.load_state_dict(copy.deepcopy(snap.optimizer))  # keep the snapshot intact for a second rollback
    if scheduler is not None and snap.scheduler is not None:
        scheduler.load_state_dict(copy.deepcopy(snap.scheduler))
    if sampler is not None and snap.sampler is not None:
        sampler.load_state_dict(snap.sampler)
    torch_rng, py_rng, np_rng, positions = snap.rng
    torch.set_rng_state(torch_rng)
    random.setstate(py_rng)
    np.random.set_state(np_rng)
    restore_positions(model, positions)
