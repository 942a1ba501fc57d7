"""Cross-entropy over vocabulary-parallel logits, without ever materialising the full-vocabulary logits on a rank.

Megatron-core ``tensor_parallel/cross_entropy.py`` (Shoeybi et al. 2019). Rank r holds the logits of vocabulary ids
``[r*V/tp, (r+1)*V/tp)`` for every token (the output of a vocabulary-parallel head). Per token:

1. ``m`` = all-reduce(MAX) of the local maxima (for a stable softmax; no gradient flows through it);
2. the target's logit ``z_t - m`` is read by the one rank that owns id t (the others contribute 0), and every rank's
   ``sum_j exp(z_j - m)`` over its own ids; both are summed in ONE all-reduce of a (2, tokens) tensor;
3. ``loss = log(sum exp) - (z_t - m)``.

Backward needs no communication: ``dloss/dz_j = softmax_j - [j == t]``, and each rank computes it for its own ids from
the softmax it kept. Traffic per call: 3 x tokens x 4 bytes of all-reduce payload (tokens = logits.numel() / (V/tp)),
instead of the tokens x V logits a gather would move. Half-precision logits are computed in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..comm.base import Communicator, ReduceOp
from ..graph_gradients import refuse_second_order

__all__ = ["vocab_parallel_cross_entropy"]

_REDUCTIONS = ("mean", "sum", "none")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, comm: Communicator,  # noqa: ANN001
                ignore_index: int) -> torch.Tensor:
        v_local = logits.shape[-1]
        start = comm.rank * v_local
        x = logits.detach().reshape(-1, v_local)
        if x.dtype in (torch.float16, torch.bfloat16):
            x = x.float()
        t = target.reshape(-1)
        m = x.max(dim=-1).values
        comm.all_reduce(m, ReduceOp.MAX)
        shifted = x - m.unsqueeze(-1)
        owned = (t >= start) & (t < start + v_local)
        local_t = (t - start).masked_fill(~owned, 0)
        target_logit = shifted.gather(1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
        exp = shifted.exp_()  # shifted is ours: reuse its memory
        both = torch.stack([target_logit, exp.sum(dim=-1)])
        comm.all_reduce(both, ReduceOp.SUM)
        valid = t != ignore_index
        loss = (both[1].log() - both[0]).masked_fill(~valid, 0.0)
        softmax = exp.div_(both[1].unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, owned & valid, valid)
        ctx.logits_dtype, ctx.logits_shape = logits.dtype, logits.shape
        return loss.view(target.shape).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):  # noqa: ANN001, ANN205
        refuse_second_order("the vocabulary-parallel cross-entropy")
        softmax, local_t, owned_valid, valid = ctx.saved_tensors
        g = grad_loss.reshape(-1).to(softmax.dtype) * valid
        grad = softmax * g.unsqueeze(-1)
        grad.scatter_add_(1, local_t.unsqueeze(-1), (-g * owned_valid).unsqueeze(-1))
        return grad.view(ctx.logits_shape).to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, comm: Communicator, *,
                                 ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of vocabulary-parallel logits against global target ids; equals ``F.cross_entropy`` of the
    gathered logits in value and gradient.

    logits: (..., V/tp), this rank's slice of the vocabulary (ids ``[rank*V/tp, (rank+1)*V/tp)``), e.g. the output of
        a ColumnParallelLinear head with gather_output=False. target: (...) int64 global ids.
    ignore_index, reduction: as ``F.cross_entropy`` ("mean" averages over the targets that are not ignored).
    Collective: every rank of `comm` calls it with its own slice. A group of one calls ``F.cross_entropy``.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"vocab_parallel_cross_entropy: reduction={reduction!r}; allowed {_REDUCTIONS}")
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"vocab_parallel_cross_entropy: target shape {tuple(target.shape)} must equal the logits "
                         f"shape {tuple(logits.shape)} without its last (vocabulary) dim")
    if target.is_floating_point():
        raise ValueError(f"vocab_parallel_cross_entropy: target must hold integer class ids, got {target.dtype}")
    if comm.size == 1:
        flat = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                               ignore_index=ignore_index, reduction=reduction)
        return flat.view(target.shape) if reduction == "none" else flat
    losses = _VocabParallelCrossEntropy.apply(logits, target, comm, ignore_index)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (target != ignore_index).sum()
