"""DiLoCo: local SGD whose outer optimizer is SGD with Nesterov momentum (Douillard et al., arXiv 2311.08105).

The paper trains each worker with AdamW for H = 500 inner steps and steps the averaged outer gradient with SGD,
lr 0.7, momentum 0.9, Nesterov: at matching perplexity it communicates ~500x less than data parallel. `DiLoCo` is
`LocalSGD` with that outer optimizer built for you; the inner optimizer stays the user's (AdamW in the paper).
With `fragments=F > 1` or `overlap_steps=tau > 0` it is Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512;
streaming.py): fragments synchronised on a staggered schedule, each all-reduce overlapped with tau inner steps.
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm.base import Communicator
from ..compression.base import Compressor
from .local_sgd import LocalSGD, Reduce
from .streaming import StreamingDiLoCo

__all__ = ["DiLoCo"]


def DiLoCo(
    module: nn.Module,
    comm: Communicator,
    *,
    sync_every: int = 500,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    nesterov: bool = True,
    reduce: Reduce | None = None,
    compression: Compressor | None = None,
    fragments: int = 1,
    overlap_steps: int = 0,
    alpha: float = 0.0,
) -> nn.Module:
    """`LocalSGD(module, comm, sync_every=H, outer_optimizer=SGD(lr=outer_lr, momentum=outer_momentum,
    nesterov=nesterov))`. Defaults are the paper's. `nesterov` is ignored when outer_momentum is 0 (plain outer
    SGD): outer_lr=1, outer_momentum=0 is plain parameter averaging. `compression` sends the outer gradients
    compressed (a sw.compression method, error feedback per rank; see LocalSGD).

    fragments / overlap_steps / alpha: Streaming DiLoCo (`sw.StreamingDiLoCo`, which takes them and its `pattern`):
    F groups of layer blocks synchronised H/F steps apart, each all-reduce applied tau steps after it starts and
    merged as alpha * local + (1 - alpha) * global. The defaults (1, 0) are DiLoCo as above."""
    if fragments != 1 or overlap_steps != 0 or alpha != 0:
        if reduce is not None:
            raise ValueError(f"DiLoCo: fragments={fragments!r} / overlap_steps={overlap_steps!r} / alpha={alpha!r} "
                             f"(Streaming DiLoCo) does not take reduce=; allowed: compression= with streaming, or "
                             f"reduce= with fragments=1, overlap_steps=0")
        return StreamingDiLoCo(module, comm, sync_every=sync_every, fragments=fragments, overlap_steps=overlap_steps,
                               alpha=alpha, outer_lr=outer_lr, outer_momentum=outer_momentum, nesterov=nesterov,
                               compression=compression)
    for name, value, low in (("outer_lr", outer_lr, "> 0"), ("outer_momentum", outer_momentum, "in [0, 1)")):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (
            value > 0 if name == "outer_lr" else 0 <= value < 1)
        if not ok:
            raise ValueError(f"DiLoCo: {name}={value!r} must be a number {low}")
    if not isinstance(nesterov, bool):
        raise ValueError(f"DiLoCo: nesterov={nesterov!r} must be True or False")
    use_nesterov = nesterov and outer_momentum > 0

    def outer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=outer_lr, momentum=outer_momentum, nesterov=use_nesterov)

    model = LocalSGD(module, comm, sync_every=sync_every, outer_optimizer=outer, reduce=reduce,
                     compression=compression)
    model._local_sgd.method = "DiLoCo"  # errors name it as the user called it
    return model
