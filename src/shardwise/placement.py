"""One device per Communicator: strategies put the model where their communicator's collectives run.

`comm.device` is where a rank's tensors live for its backend: CPU for thread, gloo and MPI ranks, this rank's GPU
for NCCL (`sw.init()` chooses it, see launch/environment.py). NCCL only moves CUDA tensors, so a model left on CPU
(the README quickstart builds it before wrapping) would fail at the first broadcast; PyTorch DDP has users move the
model first (`model.to(rank)`), FSDP takes a `device_id` and moves it for them. shardwise does the latter at wrap
time: `to_comm_device` moves a model whose tensors are all on CPU to `comm.device`, keeps one already there, and
refuses what it cannot do right (meta tensors, another GPU, CUDA tensors under a CPU backend) with an error naming
both devices. Parameters are moved in place (`Module.to`), so their identities, and every reference to them, stay.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["comm_device", "to_comm_device"]


def comm_device(comm: object) -> torch.device:
    """The device of `comm`'s collectives (CPU for a communicator that does not say)."""
    return torch.device(getattr(comm, "device", "cpu"))


def to_comm_device(module: nn.Module, comm: object, who: str) -> torch.device:
    """Move `module` (parameters and buffers) to `comm.device` if it is on CPU; return that device.

    Raises ValueError naming both devices when the module cannot be moved there safely: meta tensors (materialise
    them first, e.g. `to_empty(device=...)` and an init), tensors on another accelerator device, or a mix the
    communicator cannot reach.
    """
    target = comm_device(comm)
    devices = {t.device for t in (*module.parameters(), *module.buffers())}
    if not devices or devices == {target}:
        return target
    stray = sorted(str(d) for d in devices if d != target and d.type != "cpu")
    if "meta" in stray and target.type != "meta":
        raise ValueError(f"{who}: the model has parameters or buffers on the meta device (no values yet); materialise "
                         f"them on {target} first (module.to_empty(device={str(target)!r}) and an initialisation)")
    if stray:
        backend = getattr(comm, "backend", "?")
        raise ValueError(
            f"{who}: the model has tensors on {stray} but its communicator ({backend}) runs on {target}; move the "
            f"model to {target} before wrapping (or leave it on CPU and shardwise moves it), or use a communicator "
            f"whose device holds it")
    # Only CPU tensors (and perhaps some already on the target): move them where the collectives run.
    move_keeping_ties(module, target)
    return target


def move_keeping_ties(module: nn.Module, target: torch.device | str) -> None:
    """`module.to(target)`, except that a buffer shared by several modules stays one tensor (Module.to moves each
    module's buffer entry on its own, which unties them; parameters are moved in place through `.data` and stay
    shared)."""
    map_buffers(module, lambda buf: buf.to(target))
    module.to(target)


def map_buffers(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Replace every buffer of `module` by `fn(buffer)`, once per tensor: a buffer shared by several modules (one
    tensor under several names) gets one result, registered under each of its names, so it stays shared."""
    done: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for key, buf in sub._buffers.items():
            if buf is not None:
                if id(buf) not in done:
                    done[id(buf)] = fn(buf)
                sub._buffers[key] = done[id(buf)]
