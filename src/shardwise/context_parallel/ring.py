"""Ring attention: exact causal (or bidirectional) attention over a sequence split across a context-parallel group.

Liu, Zaharia and Abbeel (2023), "Ring Attention with Blockwise Transformers for Near-Infinite Context", arXiv
2310.01889. Each of the cp ranks holds the queries, keys and values of its own tokens (split.py: one chunk, or
two zigzag chunks). Attention needs every query against every earlier key, so the key/value blocks travel around
the ring of ranks while the queries stay put.

Forward, on each rank, cp steps. At step s the rank holds the key/value block of rank ``(rank - s) mod cp``. It
first posts the exchange for the next step (send the block it holds to rank+1, receive the next from rank-1, in
one ``batch_isend_irecv``, NCCL's rule), then computes attention of its query chunks against the block it holds,
then waits: the transfer overlaps the block's compute. Each (query chunk, key chunk) pair is a *block*: skipped if
the key chunk comes after the query chunk in the sequence (masked out entirely by causality), computed with a
triangular mask if it is the same chunk, in full otherwise. A block gives a partial output ``o_b = softmax(S_b) V_b``
and its log-sum-exp ``l_b = logsumexp(S_b)`` per query row; partial results merge exactly by the log-sum-exp rule
(the online softmax of Milakov and Gimelshein 2018, FlashAttention, Dao et al. 2022)::

    l = logaddexp(l_acc, l_b);   o = exp(l_acc - l) o_acc + exp(l_b - l) o_b

so after cp steps every query row has softmax over all its keys, whatever the order the blocks came in. The rank
keeps for backward only its own q, k, v, the output and the log-sum-exp (O(T/cp) per rank, never T x T scores).

Backward, also a ring (as in the ring-flash-attention and torchtitan implementations). Each rank recomputes the
probabilities of each block from the saved log-sum-exp, ``P = exp(S - l)``, and applies FlashAttention's backward
with ``D = rowsum(dO * O)``: ``dV += P^T dO``, ``dS = P * (dO V^T - D)``, ``dQ += dS K scale``, ``dK += dS^T Q scale``.
dQ stays on the rank. The key/value blocks travel the ring again, and the gradients of a block's keys and values
travel *with* it: at step s the rank adds its contribution to the accumulator that arrived with the block and
sends the sum on; after cp steps the accumulator has visited every rank and a final hop brings each rank the
complete dK, dV of its own keys and values. Traffic per rank: forward (cp-1) x |K|+|V|, backward (cp-1) x |K|+|V|
plus cp x |dK|+|dV|.

Zigzag (split.py) gives every rank the same number of computed blocks at every step after the first, so no rank
waits for another; with the contiguous split rank cp-1 computes cp blocks while rank 0 computes one.

Bidirectional attention (``causal=False``: encoders, vision and diffusion transformers) computes every block in
full, so the ring runs with every rank busy at every step, whatever the split.

A sliding window (key k visible to query q iff ``q - window < k <= q``) masks each block by the global positions of
its query and key chunks, and skips the blocks it leaves entirely out of reach; a query row with no visible key
in a block gets probability 0 from it (its log-sum-exp is -inf there and it is merged with weight 0). Packed
documents (documents.py) mask each block by document too: a query sees only keys of its own document. The blocks'
math is in blocks.py.

The ring runs when every rank's queries see keys of every other rank (causal attention over zigzag chunks). When
some pair of ranks sees nothing of each other (a window shorter than the sequence, packed documents, the
contiguous split), `ring_attention` runs :class:`~shardwise.context_parallel.direct.DirectAttention` instead: each
block goes straight to the ranks that need it (direct.py), with the same blocks and results.

Soft-capped scores (Gemma 2) are capped inside every block, forward and backward (the cap's derivative multiplies
dS). Attention sinks (GPT-OSS; Xiao et al. 2023, arXiv 2309.17453: one logit per head in every softmax denominator,
with no value) enter once, after the last block, as one more term of each row's log-sum-exp; the backward's
probabilities are then computed against that final log-sum-exp, and the sink's own gradient is
``-sum over rows of P(sink) D``.

Grouped-query attention (fewer key/value heads than query heads, Llama): the key/value blocks travel with their
own head count (less traffic) and are repeated to the query heads only inside each block; their gradients are
summed back over the repeated heads. The blocks are computed with matmuls in float32 or wider (float64 stays
float64), so the result is exact to rounding; a fused kernel returning the log-sum-exp would replace
`_block_forward` / `_block_backward` on GPUs.
"""

from __future__ import annotations

import math

import torch

from ..comm.base import Communicator, P2POp
from ..graph_gradients import refuse_second_order
from .blocks import Blocks, backward_start, finish, sinks_grad, start
from .direct import DirectAttention, wait_all
from .documents import check_documents, whole_documents
from .split import SequenceSplit

__all__ = ["ring_attention", "RingAttention", "autocast_inputs", "check_causal", "check_extras", "check_qkv",
           "check_window"]


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, who: str) -> tuple[int, int]:
    """ValueError unless q, k (B, H / Hkv, L, D) and v (B, Hkv, L, Dv) fit together; returns (H, Hkv). The values'
    head size may differ from the queries' and keys' (DeepSeek's multi-head latent attention)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or not t.is_floating_point():
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{who}: {name} must be a floating-point tensor of shape (batch, heads, local tokens, "
                             f"head_dim), got {shape}")
    if k.shape[:-1] != v.shape[:-1] or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:] \
            or len({q.dtype, k.dtype, v.dtype}) > 1:
        raise ValueError(f"{who}: q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, v {tuple(v.shape)} "
                         f"{v.dtype} must agree in batch, tokens, head_dim (q and k) and dtype, k and v in heads too")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{who}: query heads {q.shape[1]} must be a multiple of key/value heads {k.shape[1]}")
    return q.shape[1], k.shape[1]


def exchange(comm: Communicator, send: torch.Tensor) -> tuple[torch.Tensor, list]:
    """Post: send `send` to rank+1, receive a tensor like it from rank-1 (one batch). Returns (buffer, works)."""
    recv = torch.empty_like(send)
    works = comm.batch_isend_irecv([P2POp.send(send, (comm.rank + 1) % comm.size),
                                    P2POp.recv(recv, (comm.rank - 1) % comm.size)])
    return recv, works


class RingAttention(torch.autograd.Function):
    """Causal ring attention as one autograd node: forward and backward both pass blocks around the ring (see the
    module docstring). Call through :func:`ring_attention`, which validates the arguments."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, comm, split, blocks):  # noqa: ANN001, ANN205
        n, rank = comm.size, comm.rank
        acc, _, qs, out, lse = start(q, v, split.chunks_per_rank)
        kv = torch.cat([k, v], dim=-1).to(acc)  # one transfer per step; v's head size may differ from k's
        for step in range(n):
            if step < n - 1:
                nxt, works = exchange(comm, kv)
            blocks.forward(rank, (rank - step) % n, kv, qs, out, lse)
            if step < n - 1:
                wait_all(works)
                kv = nxt
        o, lse = finish(out, lse, sinks, q.dtype)
        ctx.save_for_backward(q, k, v, o, lse, sinks)
        ctx.comm, ctx.split, ctx.blocks = comm, split, blocks
        return o

    @staticmethod
    def backward(ctx, do):  # noqa: ANN001, ANN205
        refuse_second_order("context parallel's ring attention")
        q, k, v, o, lse, sinks = ctx.saved_tensors
        comm, blocks = ctx.comm, ctx.blocks
        n, rank = comm.size, comm.rank
        qs, dos, lses, deltas, delta, dq = backward_start(q, o, lse, do, blocks.c)
        kv = torch.cat([k, v], dim=-1).to(lse.dtype)
        dkv_in, dkv_works = None, []
        for step in range(n):
            if step < n - 1:
                nxt, works = exchange(comm, kv)
            dkv = torch.zeros_like(kv)
            blocks.backward(rank, (rank - step) % n, kv, qs, dos, lses, deltas, dq, dkv)
            if dkv_in is not None:  # the block's gradient from the ranks that held it before
                wait_all(dkv_works)
                dkv += dkv_in
            if n > 1:  # pass it on; after the last step this hop returns it to the block's owner
                dkv_in, dkv_works = exchange(comm, dkv)
            else:
                dkv_in = dkv
            if step < n - 1:
                wait_all(works)
                kv = nxt
        wait_all(dkv_works)
        dk = k.shape[-1]
        return (torch.cat(dq, dim=2).to(q.dtype), dkv_in[..., :dk].to(k.dtype), dkv_in[..., dk:].to(v.dtype),
                sinks_grad(sinks, lse, delta), None, None, None)


def autocast_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v in the autocast dtype when autocast is on for their device, as the matmuls of an eager attention would
    take them (a rotary embedding under autocast returns float32 q and k beside a bfloat16 v); else as given."""
    device = q.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        return tuple(t.to(dtype) for t in (q, k, v))
    return q, k, v


def check_window(window: object, who: str) -> int | None:
    """ValueError unless `window` is None or a positive int (a sliding window: keys less than `window` back)."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"{who}: window={window!r} must be a positive int (or None)")
    return window


def check_causal(causal: object, window: int | None, who: str) -> bool:
    """ValueError unless `causal` is a bool, and a window comes with causal attention (a window here reaches back)."""
    if not isinstance(causal, bool):
        raise ValueError(f"{who}: causal={causal!r} must be a bool")
    if not causal and window is not None:
        raise ValueError(f"{who}: window={window} with causal=False: the sliding window reaches back from each query "
                         f"(causal attention); allowed with bidirectional attention: window=None")
    return causal


def check_extras(q: torch.Tensor, softcap: float | None, sinks: torch.Tensor | None, who: str) -> float | None:
    """ValueError unless softcap is None or a positive number and sinks None or one logit per query head."""
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0:
            raise ValueError(f"{who}: softcap={softcap!r} must be a positive number (or None)")
        softcap = float(softcap)
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (q.shape[1],)):
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(f"{who}: sinks must be a tensor of one logit per query head, shape ({q.shape[1]},), "
                         f"got {shape}")
    return softcap


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator, *, zigzag: bool = True,
                   scale: float | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
                   window: int | None = None, documents: torch.Tensor | None = None, causal: bool = True
                   ) -> torch.Tensor:
    """Causal (or bidirectional) attention of this rank's queries against the whole sequence's keys, by ring attention.

    q: (B, H, L, D) this rank's L = T / cp tokens in the order `split_sequence` gives them (zigzag: chunks r and
    2cp-1-r); k: (B, Hkv, L, D) with H a multiple of Hkv; v: (B, Hkv, L, Dv), Dv = D or not (DeepSeek's latent
    attention); the output is (B, H, L, Dv). Every rank of `comm` calls it together (forward and
    backward communicate). scale: multiplies q k^T; default 1 / sqrt(D). softcap: scores become
    ``softcap * tanh(s / softcap)`` before the softmax (Gemma 2). sinks: (H,) one extra logit per head in every
    softmax denominator, with no value (GPT-OSS's attention sinks; it gets a gradient). window: a sliding window,
    query position q sees keys k with ``q - window < k <= q`` (Mistral, Gemma 2/3, GPT-OSS's sliding layers); blocks
    entirely outside it are skipped. documents: packed sequences, an integer id per token (documents.py); a query
    sees only keys of its own document: (B or 1, L) for this rank's tokens (cut by `split_sequence`; one all-gather
    reassembles them) or (B or 1, T) for the whole sequence's, the same on every rank. causal: False for
    bidirectional attention (an encoder, a vision or diffusion transformer: every query sees every key of its
    document; no window). Returns (B, H, L, D), what ``F.scaled_dot_product_attention(..., is_causal=causal)`` on
    the whole sequence gives for these tokens (with the cap and the sinks applied as HuggingFace's eager attention
    applies them). Under autocast q, k and v are taken in
    the autocast dtype (`autocast_inputs`) and the blocks still accumulate in float32. ValueError if the shapes
    disagree or L is odd under zigzag.
    """
    q, k, v = autocast_inputs(q, k, v)
    check_qkv(q, k, v, "ring_attention")
    softcap = check_extras(q, softcap, sinks, "ring_attention")
    window = check_window(window, "ring_attention")
    causal = check_causal(causal, window, "ring_attention")
    split = SequenceSplit(comm.size, zigzag)
    split.chunk_len(q.shape[2], "ring_attention")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if documents is not None:
        documents = whole_documents(check_documents(documents, q, comm.size, "ring_attention"), comm, split,
                                    q.shape[2])
    blocks = Blocks(split, q.shape[2] // split.chunks_per_rank, q.shape[1] // k.shape[1], k.shape[-1], scale,
                    softcap, window, documents, causal)
    # Every rank's queries see keys of every other rank (causal attention under zigzag, bidirectional attention):
    # the ring. Some pairs
    # see nothing of each other (a window, packed documents): each block goes straight to the ranks that need it.
    ring = all(blocks.needs(dst, src) for dst in range(comm.size) for src in range(comm.size))
    with torch.autocast(q.device.type, enabled=False):  # the blocks accumulate in float32 forward and backward
        return (RingAttention if ring else DirectAttention).apply(q, k, v, sinks, comm, split, blocks)
