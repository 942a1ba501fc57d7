"""The blocks of blockwise attention: which (query chunk, key chunk) pairs exist, their masks, their math.

Ring attention (ring.py) and its direct exchange (direct.py) cut the sequence into chunks (split.py) and compute
attention one *block* at a time: this rank's query chunk against one key/value chunk. A block exists when some
query in it may see some key in it: the key chunk is not after the query chunk (causality; bidirectional attention
has no such rule), not entirely before a sliding window's reach, and, for packed documents (documents.py), shares a
document id range with the query chunk in some row. Inside a block the exact mask (`visibility`) hides the rest, and a block all of whose entries are
hidden after all (documents interleaved) is skipped at run time and remembered for the backward.

Each block gives a partial output ``o_b = softmax(S_b) V_b`` and log-sum-exp ``l_b`` per query row, merged exactly
(the online softmax of Milakov and Gimelshein 2018, FlashAttention, Dao et al. 2022)::

    l = logaddexp(l_acc, l_b);   o = exp(l_acc - l) o_acc + exp(l_b - l) o_b

and its backward recomputes the probabilities from the saved log-sum-exp, ``P = exp(S - l)``, and applies
FlashAttention's backward with ``D = rowsum(dO * O)``: ``dV += P^T dO``, ``dS = P * (dO V^T - D)``,
``dQ += dS K scale``, ``dK += dS^T Q scale``. Soft-capped scores (Gemma 2) are capped in every block and the cap's
derivative multiplies dS. Grouped-query key/value heads are repeated to the query heads inside each block only, and
their gradients summed back.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .documents import visibility
from .split import SequenceSplit

__all__ = ["Blocks", "sink_logits", "start", "finish", "backward_start", "sinks_grad"]


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
    """The block's scores, soft-capped (``softcap * tanh(s / softcap)``, Gemma 2) when asked, -inf where `masked`;
    and the tanh before masking (the cap's derivative is ``1 - tanh^2``), None without a cap."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    capped = None
    if softcap is not None:
        capped = torch.tanh(s / softcap)
        s = capped * softcap
    if masked is not None:
        s = s.masked_fill(masked, float("-inf"))
    return s, capped


def sink_logits(sinks: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """(H,) per-head sink logits as (1, H, 1), to broadcast against a (B, H, rows) log-sum-exp."""
    return sinks.to(acc).view(1, -1, 1)


class Blocks:
    """The blocks of one attention call on one rank: chunks of `c` tokens, `groups` query heads per key/value head,
    keys' head size `dk` (the values' follow it in the packed key/value tensor), the scale, soft cap, window and
    whole-sequence document ids (b, T) or None."""

    def __init__(self, split: SequenceSplit, c: int, groups: int, dk: int, scale: float, softcap: float | None,
                 window: int | None, documents: torch.Tensor | None, causal: bool = True) -> None:
        self.split, self.c, self.groups, self.dk = split, c, groups, dk
        self.scale, self.softcap, self.window, self.documents = scale, softcap, window, documents
        self.causal = causal  # False: bidirectional (every key chunk of the query's documents is a block)
        self.hidden: set[tuple[int, int]] = set()  # blocks found entirely hidden in the forward
        self._ranges = None
        if documents is not None:  # per chunk and row, the least and greatest document id (one host sync)
            chunks = documents.reshape(documents.shape[0], split.n_chunks, c)
            self._ranges = (chunks.amin(-1).T.tolist(), chunks.amax(-1).T.tolist())

    def pairs(self, rank: int, src: int) -> Iterator[tuple[int, int, int, int]]:
        """(local query chunk a, key chunk b of rank src's block, qid, kid) for every block of rank `rank`'s queries
        and rank `src`'s keys that may have a visible key (module docstring)."""
        c, window = self.c, self.window
        for a, qid in enumerate(self.split.chunks(rank)):
            for b, kid in enumerate(self.split.chunks(src)):
                if (not self.causal or kid <= qid and (window is None or (kid + 1) * c - 1 > qid * c - window)) \
                        and not self._apart(qid, kid):
                    yield a, b, qid, kid

    def needs(self, rank: int, src: int) -> bool:
        """Whether rank `rank`'s queries see any key of rank `src`."""
        return next(self.pairs(rank, src), None) is not None

    def _apart(self, qid: int, kid: int) -> bool:
        """Whether in every row the two chunks' document id ranges do not meet (no key can share a query's id)."""
        if self._ranges is None:
            return False
        lo, hi = self._ranges
        return all(hk < lq or hq < lk for lq, hq, lk, hk in zip(lo[qid], hi[qid], lo[kid], hi[kid]))

    def mask(self, qid: int, kid: int, device: torch.device) -> torch.Tensor | None:
        """Where query chunk `qid` may not see key chunk `kid`, by global positions and document ids; None when the
        whole block is visible."""
        c, q0, k0 = self.c, qid * self.c, kid * self.c
        if self.documents is None and (not self.causal or kid < qid and (
                self.window is None or q0 + c - 1 - self.window < k0)):
            return None
        return visibility(torch.arange(q0, q0 + c, device=device), torch.arange(k0, k0 + c, device=device),
                          self.window, self.documents, self.causal)

    def _kv(self, kv: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Key chunk b of a packed key/value block, each repeated to the query heads."""
        block = kv.narrow(2, b * self.c, self.c)
        return _repeat(block[..., :self.dk], self.groups), _repeat(block[..., self.dk:], self.groups)

    def forward(self, rank: int, src: int, kv: torch.Tensor, qs: list, out: list, lse: list) -> None:
        """Merge every block of rank `src`'s keys and values `kv` into this rank's outputs and log-sum-exps."""
        for a, b, qid, kid in self.pairs(rank, src):
            masked = self.mask(qid, kid, kv.device)
            if self.documents is not None and masked is not None and bool(masked.all()):
                self.hidden.add((qid, kid))
                continue
            kb, vb = self._kv(kv, b)
            s, _ = _scores(qs[a], kb, self.scale, masked, self.softcap)
            l_b = torch.logsumexp(s, dim=-1)
            # A row with every key of the block masked has l_b -inf: its probabilities are 0, not
            # exp(-inf - -inf) = nan, and the merge gives it weight 0.
            finite = torch.where(torch.isinf(l_b), torch.zeros_like(l_b), l_b)
            o_b = torch.matmul(torch.exp(s - finite.unsqueeze(-1)), vb)
            merged = torch.logaddexp(lse[a], l_b)
            # exp(-inf - -inf) is nan where no block has reached a row yet: such a weight is 0
            keep, add = (torch.exp(t - merged).nan_to_num(0.0).unsqueeze(-1) for t in (lse[a], l_b))
            out[a] = out[a] * keep + o_b * add
            lse[a] = merged

    def backward(self, rank: int, src: int, kv: torch.Tensor, qs: tuple, dos: tuple, lses: tuple, deltas: tuple,
                 dq: list, dkv: torch.Tensor) -> None:
        """Add every block's gradients: to this rank's dq, and to `dkv`, shaped like rank `src`'s `kv`."""
        for a, b, qid, kid in self.pairs(rank, src):
            if (qid, kid) in self.hidden:
                continue
            kb, vb = self._kv(kv, b)
            s, capped = _scores(qs[a], kb, self.scale, self.mask(qid, kid, kv.device), self.softcap)
            p = torch.exp(s - lses[a].unsqueeze(-1))
            dv = torch.matmul(p.transpose(-1, -2), dos[a])
            ds = p * (torch.matmul(dos[a], vb.transpose(-1, -2)) - deltas[a].unsqueeze(-1))
            if capped is not None:  # masked entries have p = 0, so ds is 0 there whatever the factor
                ds = ds * (1 - capped * capped)
            dq[a] += torch.matmul(ds, kb) * self.scale
            dk = torch.matmul(ds.transpose(-1, -2), qs[a]) * self.scale
            dkv[..., :self.dk].narrow(2, b * self.c, self.c).add_(_fold(dk, self.groups))
            dkv[..., self.dk:].narrow(2, b * self.c, self.c).add_(_fold(dv, self.groups))


def start(q: torch.Tensor, v: torch.Tensor, m: int) -> tuple[torch.dtype, int, list, list, list]:
    """(accumulation dtype, chunk length, query chunks, zero outputs, -inf log-sum-exps) of the forward."""
    acc = torch.promote_types(q.dtype, torch.float32)
    c = q.shape[2] // m
    qs = [t.to(acc) for t in q.split(c, dim=2)]
    out = [t.new_zeros(*t.shape[:-1], v.shape[-1]) for t in qs]
    lse = [torch.full(t.shape[:-1], float("-inf"), dtype=acc, device=q.device) for t in qs]
    return acc, c, qs, out, lse


def finish(out: list, lse: list, sinks: torch.Tensor | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The output (B, H, L, Dv) in `dtype` and the log-sum-exp (B, H, L), the sinks merged in: one more logit per
    head in every row's denominator, with no value (the output shrinks)."""
    if sinks is not None:
        for a in range(len(out)):
            merged = torch.logaddexp(lse[a], sink_logits(sinks, lse[a].dtype).expand_as(lse[a]))
            out[a] = out[a] * torch.exp(lse[a] - merged).unsqueeze(-1)
            lse[a] = merged
    # Laid out (B, L, H, D) as fused kernels return it: the caller's transpose + reshape to (B, L, H*D) is then
    # a view, so the output projection saves this same storage instead of a copy.
    o = torch.cat(out, dim=2).transpose(1, 2).to(dtype).contiguous().transpose(1, 2)
    return o, torch.cat(lse, dim=2)


def backward_start(q: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, do: torch.Tensor, c: int) -> tuple:
    """(query, output-gradient, log-sum-exp and D = rowsum(dO * O) chunks, D, zero dq chunks) of the backward."""
    do = do.to(lse.dtype)
    delta = (do * o.to(lse.dtype)).sum(-1)
    qs, dos, lses, deltas = (t.split(c, dim=2) for t in (q.to(lse.dtype), do, lse, delta))
    return qs, dos, lses, deltas, delta, [torch.zeros_like(t) for t in qs]


def sinks_grad(sinks: torch.Tensor | None, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor | None:
    """d l / d sink_h = -sum over rows of P(sink) * rowsum(dO * O); None without sinks."""
    if sinks is None:
        return None
    return -(torch.exp(sink_logits(sinks, lse.dtype) - lse) * delta).sum((0, 2)).to(sinks.dtype)
