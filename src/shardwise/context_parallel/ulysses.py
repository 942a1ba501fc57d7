"""All-to-all (Ulysses) context parallelism: trade the sequence split for a head split around attention.

Jacobs et al. (2023), "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme Long Sequence
Transformer Models", arXiv 2309.14509. Outside attention every rank holds T/cp tokens of every head. Attention is
independent per head, so one all-to-all re-partitions q, k and v from *sequence-sharded, all heads* to *all tokens,
H/cp heads*: rank j sends the tokens it holds of head group i to rank i, and receives every rank's tokens of its own
head group j. Each rank then runs ordinary full causal (or bidirectional) attention (``F.scaled_dot_product_attention``, any fused
kernel) on the whole sequence for its heads, and a second all-to-all brings the output back to sequence-sharded.
Backward is the same two all-to-alls in reverse (each all-to-all's gradient is the inverse all-to-all).

Cost: per attention layer, 4 all-to-alls (q, k and v packed into one, the output, and the same two in backward) of
(cp-1)/cp of the activations each; unlike the ring, their volume per rank shrinks as cp grows, but cp cannot exceed
the head count (nor the key/value head count under grouped-query attention, unless k and v are repeated first, which
this module does). Heads must be divisible by cp: ValueError otherwise.

Token order. The ranks' parts are gathered in rank order; under the zigzag split (split.py) that is not sequence
order, so the gathered tokens are permuted into sequence order before the causal attention and back after it (an
index_select: cheap, and it lets ring and Ulysses share one batch split).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..comm.base import Communicator
from ..graph_gradients import refuse_second_order
from .ring import autocast_inputs, check_causal, check_extras, check_qkv, check_window
from .documents import check_documents, visibility, whole_documents
from .split import SequenceSplit

__all__ = ["ulysses_attention", "AllToAll", "all_to_all"]


def _exchange(x: torch.Tensor, comm: Communicator, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    inputs = [t.contiguous() for t in x.chunk(comm.size, dim=scatter_dim)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(comm.size)]
    comm.all_to_all(outputs, inputs)
    return torch.cat(outputs, dim=gather_dim)


class AllToAll(torch.autograd.Function):
    """Forward: cut x in cp equal parts along `scatter_dim`, send part j to rank j, concatenate what arrives along
    `gather_dim` in rank order. Backward: the inverse all-to-all of the gradient (the two dims swapped)."""

    @staticmethod
    def forward(ctx, x, comm, scatter_dim, gather_dim):  # noqa: ANN001, ANN205
        ctx.comm, ctx.dims = comm, (scatter_dim, gather_dim)
        return _exchange(x, comm, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        refuse_second_order("context parallel's Ulysses all-to-all")
        scatter_dim, gather_dim = ctx.dims
        return _exchange(grad, ctx.comm, gather_dim, scatter_dim), None, None, None


def all_to_all(x: torch.Tensor, comm: Communicator, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Differentiable all-to-all (see :class:`AllToAll`); the identity for a group of one."""
    if comm.size == 1:
        return x
    if x.shape[scatter_dim] % comm.size:
        raise ValueError(f"all_to_all: dim {scatter_dim} of shape {tuple(x.shape)} is not divisible by the group "
                         f"size {comm.size}")
    return AllToAll.apply(x, comm, scatter_dim, gather_dim)


def _masked(T: int, window: int | None, documents: torch.Tensor | None, device: torch.device,
            causal: bool = True) -> torch.Tensor:
    """(T, T), or (b, 1, T, T) with `documents`, True where key k is hidden from query q over the whole sequence
    (documents.py: `visibility`)."""
    positions = torch.arange(T, device=device)
    hidden = visibility(positions, positions, window, documents, causal)
    return hidden if hidden is not None else torch.zeros(T, T, dtype=torch.bool, device=device)


def _local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
                     softcap: float | None, sinks: torch.Tensor | None, window: int | None,
                     documents: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """Full causal (or bidirectional) attention of one head group, fused (``scaled_dot_product_attention``, with a
    boolean mask under a sliding window or packed documents) unless a soft cap or sinks need the scores themselves:
    then as HuggingFace's eager attention computes them (autograd differentiates it)."""
    gqa = q.shape[1] != k.shape[1]
    if softcap is None and sinks is None:
        if window is None and documents is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
        visible = ~_masked(q.shape[2], window, documents, q.device, causal)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=gqa)
    with torch.autocast(q.device.type, enabled=False):  # the scores in float32, as the ring computes them
        return _eager_attention(q, k, v, scale, softcap, sinks, window, documents, causal)


def _eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
                     softcap: float | None, sinks: torch.Tensor | None, window: int | None,
                     documents: torch.Tensor | None, causal: bool) -> torch.Tensor:
    acc = torch.promote_types(q.dtype, torch.float32)
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1).to(acc) for t in (k, v))
    s = torch.matmul(q.to(acc), k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    T = s.shape[-1]
    s = s.masked_fill(_masked(T, window, documents, s.device, causal), float("-inf"))
    if sinks is not None:  # a column of per-head logits in the softmax, dropped from the weights
        s = torch.cat([s, sinks.to(acc).view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p[..., :T] if sinks is not None else p, v).to(q.dtype)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator, *, zigzag: bool = True,
                      scale: float | None = None, softcap: float | None = None,
                      sinks: torch.Tensor | None = None, window: int | None = None,
                      documents: torch.Tensor | None = None, causal: bool = True) -> torch.Tensor:
    """Causal (or bidirectional) attention of this rank's tokens against the whole sequence, by all-to-all over heads
    (Ulysses).

    Same contract as :func:`~shardwise.context_parallel.ring_attention`: q (B, H, L, D), k (B, Hkv, L, D), v
    (B, Hkv, L, Dv), this rank's tokens in `split_sequence` order, softcap, sinks, window, documents and causal as
    there;
    returns (B, H, L, Dv). ValueError unless H is divisible by cp = comm.size. If Hkv is not, k and v are repeated
    to H heads before the exchange. A soft cap or sinks make the local attention the eager one (the fused kernel
    has neither); a window or documents alone are a boolean mask to the fused kernel.
    """
    q, k, v = autocast_inputs(q, k, v)
    H, Hkv = check_qkv(q, k, v, "ulysses_attention")
    softcap = check_extras(q, softcap, sinks, "ulysses_attention")
    window = check_window(window, "ulysses_attention")
    causal = check_causal(causal, window, "ulysses_attention")
    cp = comm.size
    if H % cp:
        raise ValueError(f"ulysses_attention: {H} attention heads are not divisible by the context-parallel size "
                         f"cp={cp}; allowed: cp dividing the head count (or method='ring')")
    split = SequenceSplit(cp, zigzag)
    L = q.shape[2]
    split.chunk_len(L, "ulysses_attention")
    if documents is not None:
        documents = whole_documents(check_documents(documents, q, cp, "ulysses_attention"), comm, split, L)
    if Hkv % cp:
        k, v = (t.repeat_interleave(H // Hkv, dim=1) for t in (k, v))
        Hkv = H
    hq, hkv = H // cp, Hkv // cp
    # (B, cp, heads of group j, L, D) for q, k, v packed: one all-to-all sends rank j its head group of all three
    # (v apart when its head size differs: DeepSeek's latent attention).
    same = v.shape[-1] == q.shape[-1]
    packed = torch.cat([t.unflatten(1, (cp, -1)) for t in ((q, k, v) if same else (q, k))], dim=2)
    full = all_to_all(packed, comm, scatter_dim=1, gather_dim=3).squeeze(1)  # (B, hq + 2 hkv, cp L, D), rank order
    where = torch.cat([split.positions(r, L, q.device) for r in range(cp)])  # rank order -> sequence position
    order = torch.argsort(where)
    full = full.index_select(2, order)
    if same:
        qf, kf, vf = full.split([hq, hkv, hkv], dim=1)
    else:
        qf, kf = full.split([hq, hkv], dim=1)
        vf = all_to_all(v.unflatten(1, (cp, -1)), comm, scatter_dim=1, gather_dim=3).squeeze(1).index_select(2, order)
    mine = None if sinks is None else sinks.narrow(0, comm.rank * hq, hq)  # this rank's head group
    y = _local_attention(qf, kf, vf, scale, softcap, mine, window, documents, causal)
    y = y.index_select(2, where).unflatten(2, (cp, L))  # back to rank order: (B, hq, cp, L, D)
    return all_to_all(y, comm, scatter_dim=2, gather_dim=1).squeeze(2)  # (B, H, L, D)
