"""Shared float64 attention cases of the context-parallel tests: q, k, v and an output gradient of one whole
sequence (grouped-query heads), HuggingFace's eager formula on it, and the same computed under context parallel."""

from __future__ import annotations

import torch

from shardwise import context_parallel as cp

B, H, HKV, T, D = 2, 4, 2, 16, 8
_GEN = torch.Generator().manual_seed(0)
Q, K, V, DO = (torch.randn(B, h, T, D, generator=_GEN, dtype=torch.float64) for h in (H, HKV, HKV, H))
SINKS = torch.randn(H, generator=_GEN, dtype=torch.float64)
SOFTCAP = 0.7  # |q k^T| / sqrt(D) reaches ~3 here: a cap this small bends most scores


def eager_attention(softcap, sinks, window=None, documents=None, causal=True):
    """HuggingFace's eager formula on the whole sequence (Gemma 2's cap, GPT-OSS's sink column, a window, packed
    documents' (B, T) ids; bidirectional without `causal`): output and gradients of <output, DO> for q, k, v and the
    sinks."""
    q, k, v = (t.clone().requires_grad_() for t in (Q, K, V))
    s_param = None if sinks is None else sinks.clone().requires_grad_()
    kr, vr = (t.repeat_interleave(H // HKV, dim=1) for t in (k, v))
    s = q @ kr.transpose(-1, -2) / D ** 0.5
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    q_pos, k_pos = torch.arange(T).unsqueeze(-1), torch.arange(T).unsqueeze(0)
    hidden = ((k_pos > q_pos) if causal else torch.zeros(T, T, dtype=torch.bool)) | (
        (k_pos <= q_pos - window) if window is not None else False)
    if documents is not None:
        hidden = hidden | (documents[:, None, :, None] != documents[:, None, None, :])
    s = s.masked_fill(hidden, float("-inf"))
    if s_param is not None:
        s = torch.cat([s, s_param.view(1, H, 1, 1).expand(B, H, T, 1)], dim=-1)
    out = torch.softmax(s, dim=-1)[..., :T] @ vr
    out.backward(DO)
    return [out.detach(), q.grad, k.grad, v.grad] + ([] if s_param is None else [s_param.grad])


def cp_attention(comm, fn, zigzag, softcap, sinks, window=None, documents=None, causal=True):
    """The same under context parallel; `documents` (B, T) as given (the whole sequence's) or, with a leading
    "split", cut like the tokens."""
    q_r, k_r, v_r, do_r = (cp.split_sequence(t, comm, zigzag=zigzag, dim=2).requires_grad_() for t in (Q, K, V, DO))
    s_param = None if sinks is None else sinks.clone().requires_grad_()
    if isinstance(documents, tuple):  # ("split", ids): this rank's part
        documents = cp.split_sequence(documents[1], comm, zigzag=zigzag)
    out = fn(q_r, k_r, v_r, comm, zigzag=zigzag, softcap=softcap, sinks=s_param, window=window, documents=documents,
             causal=causal)
    out.backward(do_r.detach())
    got = [cp.gather_sequence(t, comm, zigzag=zigzag, dim=2) for t in (out, q_r.grad, k_r.grad, v_r.grad)]
    if s_param is not None:  # each rank's share of the sinks' gradient (its tokens): summed over the group
        total = s_param.grad.clone()
        comm.all_reduce(total)
        got.append(total)
    return got
