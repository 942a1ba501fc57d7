"""What a rank holds in memory: bytes of parameters, gradients and optimizer state, and the process's peak.

`memory_stats(model, optimizer)` counts the tensors this rank actually holds (shared storages counted once), so
tests can assert the numbers of each strategy against the textbook formulas (ZeRO, Rajbhandari et al. 2020:
with Adam in fp32, DDP holds 4 + 4 + 8 = 16 bytes per parameter on every rank). Gradient bytes include a data
parallel wrapper's flat gradient buckets even between steps (they stay allocated, as in PyTorch DDP).
"""

from __future__ import annotations

import dataclasses
import resource
import sys

import torch
from torch import nn

from .. import layout
from ..sharded_tensor import local

__all__ = ["MemoryStats", "memory_stats", "peak_rss_bytes"]


@dataclasses.dataclass(frozen=True)
class MemoryStats:
    """Bytes held by this rank.

    params: parameter storage. grads: gradient storage (a DDP model's buckets, else live `.grad` tensors).
    optimizer: optimizer state tensors (0 when no optimizer is given). gathered_peak: the largest buffer of
    temporarily gathered parameters (0 for strategies that keep whole parameters). peak_rss: the process's peak
    resident set size so far (the whole process: on the thread backend it covers every rank). gathered: bytes of
    temporarily gathered parameters alive now (0 between steps and after an inference forward under ZeRO-3).
    grad_buffer_peak: the most bytes of unsharded (flat) gradient buffers the sharding engine held at once.
    host: the part of params + grads + optimizer that CPU offload keeps in host memory (0 without offload);
    `device_model_states` is the rest, what the accelerator holds.
    """

    params: int
    grads: int
    optimizer: int
    gathered_peak: int
    peak_rss: int
    gathered: int = 0
    grad_buffer_peak: int = 0
    host: int = 0

    @property
    def device_model_states(self) -> int:
        """Model states not offloaded to the host: what the device holds between steps."""
        return self.model_states - self.host

    @property
    def model_states(self) -> int:
        """params + grads + optimizer: the "model states" of the ZeRO paper."""
        return self.params + self.grads + self.optimizer

    def as_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "model_states": self.model_states,
                "device_model_states": self.device_model_states}


def _unique_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        storage = local(t).untyped_storage()
        if storage.nbytes():  # freed (resized-to-zero) buffers hold nothing
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def memory_stats(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> MemoryStats:
    """Bytes of parameters, gradients and optimizer state this rank holds for `model` (see MemoryStats).

    Strategy-blind: the parameters and gradients of the model's placements, plus what each strategy declares it
    holds besides (DDP's gradient buckets, the sharding engine's master shards, kept full buffers and flat gradient
    buffers, its peak of gathered buffers).
    """
    params: list[torch.Tensor] = [pl.param for pl in layout.placements(model).values()]
    grads = [p.grad for p in params if p.grad is not None]
    gathered_peak = gathered = grad_buffer_peak = 0
    host: list[torch.Tensor] = []
    host_params: list[torch.Tensor] = []
    for record in layout.strategies(model):
        if record.memory is not None:
            held = record.memory()
            params += held.params
            grads += held.grads
            gathered_peak = max(gathered_peak, held.gathered_peak)
            gathered += held.gathered_now
            grad_buffer_peak = max(grad_buffer_peak, held.grad_buffer_peak)
            host += held.host
            host_params += held.host_params
    state: list[torch.Tensor] = []
    if optimizer is not None:
        for per_param in optimizer.state.values():
            state.extend(v for v in per_param.values() if isinstance(v, torch.Tensor))
    # Offloaded: the host masters, and the gradients and optimizer state of the parameters that view them.
    host += [p.grad for p in host_params if p.grad is not None]
    if optimizer is not None:
        host += [v for p in host_params for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    return MemoryStats(
        params=_unique_bytes(params),
        grads=_unique_bytes(grads),
        optimizer=_unique_bytes(state),
        gathered_peak=gathered_peak,
        peak_rss=peak_rss_bytes(),
        gathered=gathered,
        grad_buffer_peak=grad_buffer_peak,
        host=_unique_bytes(host),
    )
