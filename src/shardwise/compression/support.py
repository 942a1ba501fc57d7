"""Which compression method each data-parallel strategy accepts: one table, checked at wrap time (docs mirror it).

| strategy                          | FP16 / BF16         | TopK / RandomK / OneBit | PowerSGD |
|-----------------------------------|---------------------|-------------------------|----------|
| DDP, FSDP no_shard                | yes                 | yes                     | yes      |
| ZeRO-1, ZeRO-2                    | yes (**)            | yes (*)                 | yes (*)  |
| FSDP hybrid_shard (replicate axis)| yes                 | yes                     | only with shard_size=1 |
| ZeRO-3, full_shard, shard_grad_op | yes (**), without error_feedback | no         | no       |

(*) ZeRO-1/2 replace each unit's reduce-scatter by the compressed all-reduce of the unit's gradient, then keep
this rank's shard; the error-feedback memory is as large as the unit's gradient (ZeRO-2 gives back its gradient
sharding for it). Stage 3 shards parameters to save memory that a full-size residual would spend again, so it is
refused there. hybrid_shard compresses the all-reduce of each rank's shard across the replica groups: a shard is a
1-D slice of several parameters, which PowerSGD cannot view as matrices (shard_size=1 keeps whole units).
(**) A 16-bit cast keeps the reduce-scatter (`Compressor.reduces_scatter`): each rank casts its share of the unit's
gradient in the method's rounding (BF16: stochastic by default) and one 16-bit reduce-scatter sums the shares, the
bytes of `MixedPrecision(reduce_dtype=...)`, which rounds to nearest instead (on the demo GPT, bf16 to nearest ended
+5.6% above fp32 on one seed, in ZeRO-2 as in DDP: docs/compression.md). With both set the gradient would be cast
twice: refused."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
from torch import nn

from .. import layout

from .base import Compressor
from .cast import _Cast
from .powersgd import PowerSGD

__all__ = ["check_supported", "check_copies", "copies_reconciled"]

#: Set while a caller that averages the copies of replicated parameters itself (sw.parallelize) wraps its stages.
_RECONCILED: contextvars.ContextVar[bool] = contextvars.ContextVar("shardwise_copies_reconciled", default=False)


@contextlib.contextmanager
def copies_reconciled() -> Iterator[None]:
    """Within the block, `check_copies` allows compression on models with copies: the caller averages the copies'
    gradients over their groups after the data-parallel reduction (sw.parallelize does)."""
    token = _RECONCILED.set(True)
    try:
        yield
    finally:
        _RECONCILED.reset(token)


def check_copies(module: nn.Module, compression: object, who: str) -> None:
    """Refuse lossy compression of a model whose parameters have copies on other ranks outside the data-parallel
    group: a tensor-parallel model's replicated parameters (norms, biases) or weights tied across pipeline stages.
    Each rank's compressor gives its copy a different update (different residuals, different top-k), so the copies
    drift apart step by step with no error; sw.parallelize(compression=...) averages them after the reduction."""
    if compression is None or _RECONCILED.get():
        return
    for name, pl in layout.placements(module).items():
        groups = [g for g in pl.replicated_over if g is not None and g.size > 1]
        if pl.tied_over is not None and pl.tied_over.size > 1:
            groups.append(pl.tied_over)
        if groups:
            raise ValueError(
                f"{who}: compression={type(compression).__name__} on a model whose parameter {name!r} has copies on "
                f"other ranks (tensor-parallel replicated or tied across pipeline stages): each rank's compressor "
                f"would update its copy differently and the copies would drift apart silently; use "
                f"sw.parallelize(model, mesh, compression=...), which averages the copies, or no compression")

_ALLOWED = "None or a sw.compression method (FP16(), BF16(), TopK(ratio), RandomK(ratio), PowerSGD(rank), OneBit())"


def check_supported(compression: object, strategy: str, *, reduce_dtype: torch.dtype | None = None,
                    shard_size: int = 1, replicas: int | None = None) -> Compressor | None:
    """Raise ValueError naming the method, the strategy and what is allowed, unless the table above allows it.

    strategy: "ddp", "zero1", "zero2", "zero3", "full_shard", "shard_grad_op", "no_shard", "hybrid_shard".
    shard_size: ranks per shard group (hybrid_shard), replicas: how many groups (None: not known yet),
    reduce_dtype: MixedPrecision's.
    """
    if compression is None:
        return None
    if not isinstance(compression, Compressor):
        raise ValueError(f"{strategy}: compression={compression!r} must be {_ALLOWED}")
    method = type(compression).__name__
    if isinstance(compression, _Cast) and reduce_dtype is not None:
        raise ValueError(f"{strategy}: compression={method}() and MixedPrecision(reduce_dtype={reduce_dtype}) cannot "
                         f"both be set (both choose the dtype of the gradient reduction); keep one of them")
    if strategy in ("zero3", "full_shard", "shard_grad_op") and not (
            isinstance(compression, _Cast) and not compression.error_feedback):
        raise ValueError(f"{strategy}: compression={compression!r} is not supported with sharded parameters (its "
                         f"error-feedback memory would be as large as the gradients stage 3 shards); allowed here: "
                         f"FP16() and BF16() without error_feedback (a 16-bit reduce-scatter); every method is "
                         f"allowed with DDP, ZeRO stage 1/2, FSDP no_shard, and the replicate axis of hybrid_shard")
    if strategy == "hybrid_shard" and shard_size > 1 and isinstance(compression, PowerSGD):
        raise ValueError(f"hybrid_shard: compression=PowerSGD needs whole matrices, but with shard_size={shard_size} "
                         f"the replicate axis carries 1-D shards; use FP16, BF16, TopK, RandomK or OneBit there, or "
                         f"shard_size=1 / no_shard / ZeRO-1/2 for PowerSGD")
    if strategy == "hybrid_shard" and replicas == 1:
        raise ValueError(f"hybrid_shard: compression={method} compresses the all-reduce across replica groups, but "
                         f"shard_size={shard_size} leaves one group (no replicate axis); use shard_size < the world "
                         f"size, or compression with ZeRO stage 1/2")
    if strategy not in ("ddp", "zero1", "zero2", "zero3", "full_shard", "shard_grad_op", "no_shard", "hybrid_shard"):
        raise ValueError(f"compression: unknown strategy {strategy!r}")
    return compression
