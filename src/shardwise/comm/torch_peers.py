"""torch's own data-parallel wrappers over a shardwise Communicator's process group: the peers `shardwise bench`
measures shardwise against (PyTorch DDP and FSDP2's `fully_shard`).

They live in comm/ because wrapping a model in them calls torch.distributed (DESIGN.md rule 1): the benchmark code
(benchmarks/peers.py) asks for a wrapped model and never touches a process group itself. Each wrapper runs over the
group of the Communicator it is given, the world or a group split from it; a communicator without a torch.distributed
group (threads, MPI) is refused by name, since torch's wrappers cannot run over it.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist
from torch import nn

from .torch_backend import TorchCommunicator

__all__ = ["FSDP2_REQUIRES", "fully_shard_blocks", "import_fsdp2", "torch_ddp", "torch_process_group"]

#: (module, attribute) that must import for the FSDP2 row (fully_shard is public from torch 2.6).
FSDP2_REQUIRES = ("torch.distributed.fsdp", "fully_shard")


def torch_process_group(comm: Any) -> dist.ProcessGroup:
    """The torch.distributed process group under `comm`. Raises ValueError for a communicator that has none."""
    if not isinstance(comm, TorchCommunicator):
        raise ValueError(f"torch's own DDP/FSDP2 need a torch.distributed communicator (gloo or nccl, from "
                         f"shardwise.launch(backend='gloo') or torchrun); got {type(comm).__name__}")
    return comm.group if comm.group is not None else dist.group.WORLD


def import_fsdp2() -> None:
    """Import FSDP2 ahead of a measurement (an import is not the model's cost)."""
    importlib.import_module(FSDP2_REQUIRES[0])


def torch_ddp(model: nn.Module, comm: Any) -> nn.Module:
    """`torch.nn.parallel.DistributedDataParallel(model)` over `comm`'s process group (torch's defaults otherwise)."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, process_group=torch_process_group(comm))


def fully_shard_blocks(model: nn.Module, blocks: Iterable[nn.Module], comm: Any, device_type: str = "cpu") -> nn.Module:
    """FSDP2 as torchtitan applies it: `fully_shard` on each of `blocks`, then on the root, over a one-dimensional
    DeviceMesh of `comm`'s process group. Returns `model`, sharded in place."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(torch_process_group(comm), device_type)
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
