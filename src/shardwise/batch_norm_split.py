"""BatchNorm under data parallelism: the global batch's statistics, torch DDP's per-rank ones by choice, or an error.

A BatchNorm layer in training mode (or without running statistics) normalises by the mean and variance of the batch
it sees (Ioffe & Szegedy 2015). Data parallelism gives each rank a slice of the global batch, so plain BatchNorm
under DDP, ZeRO or FSDP normalises by the slice: the outputs, gradients and running statistics all differ from one
process on the global batch (a ResNet's loss at step 0: 2.5305 against 2.5419). torch DDP does that silently; many
scripts rely on it and convert with `torch.nn.SyncBatchNorm.convert_sync_batchnorm` when the slices are small.

shardwise makes the choice explicit, with the wrappers' `batch_norm=` option:

* `"sync"`: every BatchNorm becomes `sw.SyncBatchNorm` over the wrapper's data-parallel group (in place, the same
  parameter and buffer objects; sync_batchnorm.py): statistics of the global batch, as one process computes them
  (Peng et al. 2018, "MegDet", cross-GPU batch normalisation). Two small all-reduces per layer per pass.
* `"local"`: each rank's own statistics, torch DDP's behaviour (cheaper, and the usual choice for large per-rank
  batches), knowingly not one process's.
* None (the default): a forward in which a plain BatchNorm would use batch statistics over a group of more than one
  rank raises, naming the layer and both choices. Layers in eval mode with running statistics (a frozen backbone,
  fine-tuning) normalise each sample alike on every rank and pass; so do `sw.SyncBatchNorm` and torch's own
  `nn.SyncBatchNorm`, which synchronise already.

A pipeline cuts the batch into microbatches (GPipe, Huang et al. 2019), and every BatchNorm, synchronised or not,
normalises by one microbatch at a time: `MicrobatchStatistics` makes a training step raise on every pipeline rank
when there is more than one microbatch (torchgpipe's deferred batch norm, which accumulates the statistics over the
microbatches, is not implemented).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .comm.base import Communicator, ReduceOp
from .sync_batchnorm import SyncBatchNorm

__all__ = ["BATCH_NORM_CHOICES", "MicrobatchStatistics", "apply_batch_norm_choice", "check_batch_norm_option"]

BATCH_NORM_CHOICES = (None, "sync", "local")


def check_batch_norm_option(batch_norm: Any, who: str) -> None:
    if batch_norm not in BATCH_NORM_CHOICES:
        raise ValueError(f"{who}: batch_norm={batch_norm!r} is not supported; allowed None (refuse a BatchNorm "
                         f"using per-rank batch statistics), 'sync' (the global batch's, sw.SyncBatchNorm) or "
                         f"'local' (each rank's own, torch DDP's)")


def _plain_batch_norms(model: nn.Module) -> list[tuple[str, _BatchNorm]]:
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, _BatchNorm) and not isinstance(m, (SyncBatchNorm, nn.SyncBatchNorm))]


def apply_batch_norm_choice(model: nn.Module, comm: Communicator, batch_norm: str | None, who: str) -> None:
    """Before the wrapper `who` records the model: convert (`"sync"`), leave (`"local"`), or watch every forward
    (None) the plain BatchNorm layers of `model`, data parallel over `comm` (module docstring)."""
    check_batch_norm_option(batch_norm, who)
    layers = _plain_batch_norms(model)
    if not layers or comm.size == 1 or batch_norm == "local":
        return
    if batch_norm == "sync":
        if isinstance(model, _BatchNorm):
            raise ValueError(f"{who}: batch_norm='sync' cannot convert the wrapped module itself, a "
                             f"{type(model).__name__}: wrap a module that contains it")
        SyncBatchNorm.convert(model, comm)
        return

    def refuse_batch_statistics(module: nn.Module, args: Any) -> None:
        for name, m in layers:
            if m.training or not m.track_running_stats:
                raise ValueError(
                    f"{who}: {type(m).__name__} {name or '<root>'!r} would normalise by this rank's slice "
                    f"of the batch ({'training mode' if m.training else 'no running statistics'}), one process by "
                    f"the whole batch over the {comm.size} data-parallel ranks. Wrap with batch_norm='sync' (the "
                    f"global batch's statistics: sw.SyncBatchNorm) or batch_norm='local' (each rank's own, torch "
                    f"DDP's behaviour); under sw.parallelize convert first: sw.SyncBatchNorm.convert(model, "
                    f"mesh.dp). In eval mode with running statistics it passes")

    model.register_forward_pre_hook(refuse_batch_statistics)


class MicrobatchStatistics:
    """The BatchNorm layers (SyncBatchNorm included) of a pipeline cut into more than one microbatch (module
    docstring). `check()`, at the start of each step, raises on every pipeline rank when one of them would use batch
    statistics: the ranks agree by one all-reduce of a flag, and only while some stage holds a BatchNorm at all."""

    def __init__(self, all_stages: list[nn.Module], local: dict[str, nn.Module], n_microbatches: int,
                 comm: Communicator, who: str) -> None:
        self.active = n_microbatches > 1 and any(isinstance(m, _BatchNorm) for s in all_stages for m in s.modules())
        self.layers = [(f"stage {s}: {name or '<root>'}", m) for s, stage in local.items()
                       for name, m in stage.named_modules() if isinstance(m, _BatchNorm)]
        self.n_microbatches, self.comm, self.who = n_microbatches, comm, who

    def check(self) -> None:
        if not self.active:
            return
        using = [(where, m) for where, m in self.layers if m.training or not m.track_running_stats]
        flag = torch.tensor([1.0 if using else 0.0], device=self.comm.device)
        if self.comm.size > 1:
            self.comm.all_reduce(flag, ReduceOp.MAX)
        if flag.item() > 0:
            what = (f"{type(using[0][1]).__name__} {using[0][0]!r}" if using else
                    "a BatchNorm of another pipeline rank's stage")
            raise ValueError(f"{self.who}: {what} would normalise by one microbatch (1/{self.n_microbatches} of the "
                             f"batch) in training mode, one process by the whole batch. Use n_microbatches=1, a "
                             f"per-sample norm (GroupNorm, LayerNorm), or keep it in eval mode with running statistics "
                             f"(a frozen BatchNorm)")
