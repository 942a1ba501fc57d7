"""Buffers a training forward writes: equal on every data-parallel rank, each rank's own by choice, or an error.

Many models keep state in buffers that their forward updates from the batch it sees: the codebook EMAs of a VQ-VAE
(van den Oord et al. 2017; Razavi et al. 2019) or of SoundStream/EnCodec, the key queue of MoCo (He et al. 2020),
DINO's centre (Caron et al. 2021), a running observation normaliser, InstanceNorm's running statistics. Under data
parallelism each rank sees a slice of the global batch, so each rank writes its own slice's statistics: the buffers
stop agreeing and neither matches one process on the whole batch (a running mean ended 0.052 off one process after
four steps). torch DDP hides it by broadcasting rank 0's buffers before every forward; the original code of those
papers averages the statistics over `torch.distributed` itself, which under shardwise's thread or process ranks
is not initialised, so the update silently stays per rank.

The wrappers' `buffer_writes=` option makes the choice explicit:

* None (the default): the first training forward (module in training mode, gradients enabled) ends with one small
  all-reduce comparing every buffer across the data-parallel ranks (a float64 sum and sum of squares each, as
  agreement.py fingerprints parameters). A buffer that differs raises on every rank, naming it and both remedies.
  When some rank's forward wrote a buffer (its version counter moved, or the attribute now holds another tensor) and
  they all agreed (a step counter, spectral norm's power iteration on replicated weights, a cache), every later
  training forward repeats the check; otherwise the check stops after the first. Forwards in eval mode or under
  `torch.no_grad()` are never checked (evaluation on rank 0 alone communicates nothing).
* `"local"`: each rank keeps its own values, knowingly (torch DDP's behaviour; `sw.DDP` with
  `broadcast_buffers=True` copies rank 0's to every rank before each forward, ZeRO/FSDP keep each rank's own and a
  checkpoint saves rank 0's).

To stay exact, compute the statistic over the global batch inside the forward: all-reduce it (`comm.all_reduce(t,
sw.ReduceOp.SUM)` with the communicator the model was wrapped with) before writing the buffer.

BatchNorm layers are left to the `batch_norm=` option (batch_norm_split.py). A buffer written only now and then
(a dead-code restart every hundred steps) after a first forward that wrote none is not seen.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .comm.base import Communicator, ReduceOp
from .comm.uncounted import uncounted

__all__ = ["BUFFER_WRITES_CHOICES", "WatchedBuffers", "check_buffer_writes_option", "watch_buffer_writes"]

BUFFER_WRITES_CHOICES = (None, "local")


def check_buffer_writes_option(buffer_writes: Any, who: str) -> None:
    if buffer_writes not in BUFFER_WRITES_CHOICES:
        raise ValueError(f"{who}: buffer_writes={buffer_writes!r} is not supported; allowed None (a buffer that "
                         f"a forward leaves different across the data-parallel ranks raises) or 'local' (each rank "
                         f"keeps its own, torch DDP's behaviour)")


def watch_buffer_writes(model: nn.Module, comm: Communicator, buffer_writes: str | None, who: str) -> None:
    """Before the wrapper `who` returns: check (None) or leave (`"local"`) the buffers that `model`'s training
    forwards write, data parallel over `comm` (module docstring)."""
    check_buffer_writes_option(buffer_writes, who)
    if comm.size == 1 or buffer_writes == "local":
        return
    watch = BufferWrites(model, comm, who)
    if watch.buffers():
        model.register_forward_pre_hook(watch.before)
        model.register_forward_hook(watch.after)


class WatchedBuffers:
    """The buffers of a module outside its BatchNorm layers (those follow the batch_norm= choice; the names are
    fixed when this is made), and which of them some code wrote: `note()` before it, `written(noted, named)` after.
    A write is an in-place change (the version counter moved) or another tensor now under the name."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.skipped = {f"{prefix}.{name}".lstrip(".") for prefix, m in module.named_modules()
                        if isinstance(m, _BatchNorm) for name, _ in m.named_buffers(recurse=False)}

    def named(self) -> list[tuple[str, torch.Tensor]]:
        return [(name, b) for name, b in self.module.named_buffers() if name not in self.skipped]

    def note(self) -> dict[str, tuple[int, int]]:
        return {name: (id(b), b._version) for name, b in self.named()}

    @staticmethod
    def written(noted: dict[str, tuple[int, int]], named: list[tuple[str, torch.Tensor]]) -> list[bool]:
        return [noted.get(name) != (id(b), b._version) for name, b in named]


class BufferWrites:
    """The check of one wrapped model (module docstring): `before` notes each buffer's tensor and version, `after`
    compares every buffer across the ranks and raises on a difference."""

    def __init__(self, model: nn.Module, comm: Communicator, who: str) -> None:
        self.watched, self.comm, self.who = WatchedBuffers(model), comm, who
        self.noted: dict[str, tuple[int, int]] | None = None
        self.first, self.watching = True, False

    def buffers(self) -> list[tuple[str, torch.Tensor]]:
        return self.watched.named()

    def before(self, module: nn.Module, args: Any) -> None:
        checked = module.training and torch.is_grad_enabled() and (self.first or self.watching)
        self.noted = self.watched.note() if checked else None

    @torch.no_grad()
    def after(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.noted is None:
            return
        noted, self.noted = self.noted, None
        named = self.watched.named()
        if not named:
            return
        written = WatchedBuffers.written(noted, named)
        device = self.comm.device
        flags = torch.tensor(written, dtype=torch.float64).to(device)
        stats = torch.cat([flags[:, None], torch.stack([_fingerprint(b).to(device) for _, b in named])], dim=1)
        # One MAX all-reduce gives whether any rank wrote each buffer, and the largest and smallest fingerprints.
        both = torch.cat([stats, -stats[:, 1:]], dim=1)
        with uncounted(self.comm):  # control traffic: comm.stats stays the strategy's own (comm/uncounted.py)
            self.comm.all_reduce(both, ReduceOp.MAX)
        rows = both.tolist()
        differ = [(name, bool(row[0] > 0)) for (name, _), row in zip(named, rows)
                  if row[1] != -row[3] or row[2] != -row[4]]
        self.first, self.watching = False, any(row[0] > 0 for row in rows)
        if differ:
            name, was_written = differ[0]
            how = ("this training forward wrote it" if was_written else "written by this forward through a kernel "
                   "or `.data` that leaves its version counter, or outside a checked forward")
            raise ValueError(
                f"{self.who}: buffer {name!r} differs across the {self.comm.size} data-parallel ranks ({how}: a "
                f"statistic of each rank's own slice of the batch, such as an EMA codebook, a running mean or a "
                f"queue), where one process computes it from the whole batch"
                + (f"; {len(differ) - 1} more differ: {[n for n, _ in differ[1:4]]}" if len(differ) > 1 else "")
                + ". To match one process, reduce the statistic over the ranks before writing it (comm.all_reduce "
                  "with the communicator the model was wrapped with); to keep each rank's own values knowingly "
                  "(torch DDP's behaviour), wrap with buffer_writes='local'")


def _fingerprint(b: torch.Tensor) -> torch.Tensor:
    """Sum and sum of squares in float64, on the buffer's device (bit-equal for equal values); NaN and infinities
    count as large finite markers, so that equal non-finite buffers compare equal."""
    if b.is_complex():
        b = torch.view_as_real(b)
    values = b.detach().reshape(-1).to(torch.float64).nan_to_num(nan=1.5e300, posinf=1e300, neginf=-1e300)
    return torch.stack([values.sum(), values.square().sum()]).nan_to_num(nan=0.0)
