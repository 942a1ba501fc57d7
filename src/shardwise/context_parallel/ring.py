"""Ring attention: exact causal attention over a sequence split across a context-parallel group.

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

A sliding window (key k visible to query q iff ``q - window < k <= q``) masks each block by the global positions of
its query and key chunks, and skips the blocks it leaves entirely out of reach; a query row with no visible key
in a block gets probability 0 from it (its log-sum-exp is -inf there and it is merged with weight 0). The K/V
blocks still travel the whole ring.

Packed documents (documents.py) mask each block by document too: a query sees only keys of its own document.
A block in which no query sees any key (every key in another document) is skipped, in the backward as in the
forward (the forward records which).

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
from .documents import check_documents, visibility, whole_documents
from .split import SequenceSplit

__all__ = ["ring_attention", "RingAttention", "autocast_inputs", "check_extras", "check_qkv", "check_window"]


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


def _repeat(t: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, Hkv, c, D) -> (B, Hkv * groups, c, D): query head h reads key/value head h // groups (HF's repeat_kv)."""
    if groups == 1:
        return t
    B, H, c, D = t.shape
    return t[:, :, None].expand(B, H, groups, c, D).reshape(B, H * groups, c, D)


def _fold(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of `_repeat`: sum over the repeated heads."""
    if groups == 1:
        return t
    B, H, c, D = t.shape
    return t.view(B, H // groups, groups, c, D).sum(2)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, masked: torch.Tensor | None,
            softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The block's scores, soft-capped (``softcap * tanh(s / softcap)``, Gemma 2) when asked, -inf where `masked`
    (`_block_mask`); and the tanh before masking (the cap's derivative is ``1 - tanh^2``), None without a cap."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    capped = None
    if softcap is not None:
        capped = torch.tanh(s / softcap)
        s = capped * softcap
    if masked is not None:
        s = s.masked_fill(masked, float("-inf"))
    return s, capped


def _block_forward(q, k, v, scale, masked, softcap):  # noqa: ANN001, ANN202
    s, _ = _scores(q, k, scale, masked, softcap)
    lse = torch.logsumexp(s, dim=-1)
    # A row with every key masked (a sliding window that ends before this block) has lse -inf: its probabilities
    # are 0, not exp(-inf - -inf) = nan; the merge then gives it weight 0.
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.matmul(torch.exp(s - finite.unsqueeze(-1)), v), lse


def _block_backward(q, k, v, do, lse, delta, scale, masked, softcap):  # noqa: ANN001, ANN202
    s, capped = _scores(q, k, scale, masked, softcap)
    p = torch.exp(s - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), do)
    ds = p * (torch.matmul(do, v.transpose(-1, -2)) - delta.unsqueeze(-1))
    if capped is not None:  # masked entries have p = 0, so ds is 0 there whatever the factor
        ds = ds * (1 - capped * capped)
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale, dv


def _block_mask(qid: int, kid: int, c: int, window: int | None, documents: torch.Tensor | None,
                device: torch.device) -> torch.Tensor | None:
    """Where query chunk `qid` may not see key chunk `kid` (chunks of c tokens), by their global positions and,
    for packed sequences, their document ids (documents.py: `visibility`); None when the whole block is visible."""
    q0, k0 = qid * c, kid * c
    if documents is None and kid < qid and (window is None or q0 + c - 1 - window < k0):
        return None
    return visibility(torch.arange(q0, q0 + c, device=device), torch.arange(k0, k0 + c, device=device), window,
                      documents)


def _pairs(split: SequenceSplit, rank: int, src: int, c: int, window: int | None):  # noqa: ANN202
    """(local query chunk a, key chunk b of rank src's block, qid, kid) for every block with a visible key: key
    chunks before or at the query chunk, and under a sliding window not entirely before its reach."""
    for a, qid in enumerate(split.chunks(rank)):
        for b, kid in enumerate(split.chunks(src)):
            if kid <= qid and (window is None or (kid + 1) * c - 1 > qid * c - window):
                yield a, b, qid, kid


def _sink_logits(sinks: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """(H,) per-head sink logits as (1, H, 1), to broadcast against a (B, H, rows) log-sum-exp."""
    return sinks.to(acc).view(1, -1, 1)


def _exchange(comm: Communicator, send: torch.Tensor) -> tuple[torch.Tensor, list]:
    """Post: send `send` to rank+1, receive a tensor like it from rank-1 (one batch). Returns (buffer, works)."""
    recv = torch.empty_like(send)
    works = comm.batch_isend_irecv([P2POp.send(send, (comm.rank + 1) % comm.size),
                                    P2POp.recv(recv, (comm.rank - 1) % comm.size)])
    return recv, works


def _wait(works: list) -> None:
    for w in works:
        w.wait()


class RingAttention(torch.autograd.Function):
    """Causal ring attention as one autograd node: forward and backward both pass blocks around the ring (see the
    module docstring). Call through :func:`ring_attention`, which validates the arguments."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, documents, comm, split, scale, softcap, window):  # noqa: ANN001, ANN205
        n, rank = comm.size, comm.rank
        acc = torch.promote_types(q.dtype, torch.float32)
        m = split.chunks_per_rank
        c = q.shape[2] // m
        groups = q.shape[1] // k.shape[1]
        qs = [t.to(acc) for t in q.split(c, dim=2)]
        dk = k.shape[-1]
        out = [t.new_zeros(*t.shape[:-1], v.shape[-1]) for t in qs]
        lse = [torch.full(t.shape[:-1], float("-inf"), dtype=acc, device=q.device) for t in qs]
        kv = torch.cat([k, v], dim=-1).to(acc)  # one transfer per step; v's head size may differ from k's
        hidden_blocks = set()  # blocks whose every key is in another document than every query: skipped
        for step in range(n):
            if step < n - 1:
                nxt, works = _exchange(comm, kv)
            for a, b, qid, kid in _pairs(split, rank, (rank - step) % n, c, window):
                masked = _block_mask(qid, kid, c, window, documents, q.device)
                if documents is not None and masked is not None and bool(masked.all()):
                    hidden_blocks.add((qid, kid))
                    continue
                kb, vb = (_repeat(t.narrow(2, b * c, c), groups) for t in (kv[..., :dk], kv[..., dk:]))
                o_b, l_b = _block_forward(qs[a], kb, vb, scale, masked, softcap)
                merged = torch.logaddexp(lse[a], l_b)
                # exp(-inf - -inf) is nan where no block has reached a row yet: such a weight is 0
                keep, add = (torch.exp(t - merged).nan_to_num(0.0).unsqueeze(-1) for t in (lse[a], l_b))
                out[a] = out[a] * keep + o_b * add
                lse[a] = merged
            if step < n - 1:
                _wait(works)
                kv = nxt
        if sinks is not None:  # one more logit per head in every row's denominator, with no value: o shrinks
            for a in range(m):
                merged = torch.logaddexp(lse[a], _sink_logits(sinks, acc).expand_as(lse[a]))
                out[a] = out[a] * torch.exp(lse[a] - merged).unsqueeze(-1)
                lse[a] = merged
        # Laid out (B, L, H, D) as fused kernels return it: the caller's transpose + reshape to (B, L, H*D) is then
        # a view, so the output projection saves this same storage instead of a copy.
        o = torch.cat(out, dim=2).transpose(1, 2).to(q.dtype).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, o, torch.cat(lse, dim=2), sinks, documents)
        ctx.comm, ctx.split, ctx.scale, ctx.softcap, ctx.window = comm, split, scale, softcap, window
        ctx.hidden_blocks = hidden_blocks
        return o

    @staticmethod
    def backward(ctx, do):  # noqa: ANN001, ANN205
        refuse_second_order("context parallel's ring attention")
        q, k, v, o, lse, sinks, documents = ctx.saved_tensors
        comm, split, scale, softcap, window = ctx.comm, ctx.split, ctx.scale, ctx.softcap, ctx.window
        n, rank = comm.size, comm.rank
        acc = lse.dtype
        m = split.chunks_per_rank
        c = q.shape[2] // m
        groups = q.shape[1] // k.shape[1]
        do = do.to(acc)
        delta = (do * o.to(acc)).sum(-1)
        qs, dos, lses, deltas = (t.split(c, dim=2) for t in (q.to(acc), do, lse, delta))
        dq = [torch.zeros_like(t) for t in qs]
        dk = k.shape[-1]
        kv = torch.cat([k, v], dim=-1).to(acc)
        dkv_in, dkv_works = None, []
        for step in range(n):
            if step < n - 1:
                nxt, works = _exchange(comm, kv)
            dkv = torch.zeros_like(kv)
            for a, b, qid, kid in _pairs(split, rank, (rank - step) % n, c, window):
                if (qid, kid) in ctx.hidden_blocks:
                    continue
                kb, vb = (_repeat(t.narrow(2, b * c, c), groups) for t in (kv[..., :dk], kv[..., dk:]))
                dq_b, dk_b, dv_b = _block_backward(qs[a], kb, vb, dos[a], lses[a], deltas[a], scale,
                                                   _block_mask(qid, kid, c, window, documents, q.device), softcap)
                dq[a] += dq_b
                dkv[..., :dk].narrow(2, b * c, c).add_(_fold(dk_b, groups))
                dkv[..., dk:].narrow(2, b * c, c).add_(_fold(dv_b, groups))
            if dkv_in is not None:  # the block's gradient from the ranks that held it before
                _wait(dkv_works)
                dkv += dkv_in
            if n > 1:  # pass it on; after the last step this hop returns it to the block's owner
                dkv_in, dkv_works = _exchange(comm, dkv)
            else:
                dkv_in = dkv
            if step < n - 1:
                _wait(works)
                kv = nxt
        _wait(dkv_works)
        dsinks = None
        if sinks is not None:  # d l / d sink_h = -sum over rows of P(sink) * rowsum(dO * O)
            dsinks = -(torch.exp(_sink_logits(sinks, acc) - lse) * delta).sum((0, 2)).to(sinks.dtype)
        return (torch.cat(dq, dim=2).to(q.dtype), dkv_in[..., :dk].to(k.dtype), dkv_in[..., dk:].to(v.dtype), dsinks,
                None, None, None, None, None, None)


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
                   window: int | None = None, documents: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries against the whole sequence's keys, by ring attention.

    q: (B, H, L, D) this rank's L = T / cp tokens in the order `split_sequence` gives them (zigzag: chunks r and
    2cp-1-r); k: (B, Hkv, L, D) with H a multiple of Hkv; v: (B, Hkv, L, Dv), Dv = D or not (DeepSeek's latent
    attention); the output is (B, H, L, Dv). Every rank of `comm` calls it together (forward and
    backward communicate). scale: multiplies q k^T; default 1 / sqrt(D). softcap: scores become
    ``softcap * tanh(s / softcap)`` before the softmax (Gemma 2). sinks: (H,) one extra logit per head in every
    softmax denominator, with no value (GPT-OSS's attention sinks; it gets a gradient). window: a sliding window,
    query position q sees keys k with ``q - window < k <= q`` (Mistral, Gemma 2/3, GPT-OSS's sliding layers); blocks
    entirely outside it are skipped. documents: packed sequences, an integer id per token (documents.py); a query
    sees only keys of its own document: (B or 1, L) for this rank's tokens (cut by `split_sequence`; one all-gather
    reassembles them) or (B or 1, T) for the whole sequence's, the same on every rank. Returns (B, H, L, D), what
    ``F.scaled_dot_product_attention(..., is_causal=True)`` on the whole sequence gives for these tokens (with the
    cap and the sinks applied as HuggingFace's eager attention applies them). Under autocast q, k and v are taken in
    the autocast dtype (`autocast_inputs`) and the blocks still accumulate in float32. ValueError if the shapes
    disagree or L is odd under zigzag.
    """
    q, k, v = autocast_inputs(q, k, v)
    check_qkv(q, k, v, "ring_attention")
    softcap = check_extras(q, softcap, sinks, "ring_attention")
    window = check_window(window, "ring_attention")
    split = SequenceSplit(comm.size, zigzag)
    split.chunk_len(q.shape[2], "ring_attention")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if documents is not None:
        documents = whole_documents(check_documents(documents, q, comm.size, "ring_attention"), comm, split,
                                    q.shape[2])
    with torch.autocast(q.device.type, enabled=False):  # the blocks accumulate in float32 forward and backward
        return RingAttention.apply(q, k, v, sinks, documents, comm, split, scale, softcap, window)
