"""Packed sequences under context parallel: several documents in one row, each attending only within itself.

Long-context training packs documents end to end into rows of T tokens and masks attention at their edges (the
"document mask" of Llama 3's long-context stage, Grattafiori et al. 2024, arXiv 2407.21783; Krell et al. 2021,
arXiv 2107.02027, on packing without cross-contamination), so no token reads another document. The rule of this
module: key k is visible to query q iff it is visible under the causal rule (and the sliding window, `hidden_keys`)
*and* ``documents[k] == documents[q]``, with ``documents`` (b, T) an integer id per token of the whole sequence
(b = the batch rows, or 1 for the same packing in every row).

Ring and Ulysses attention take the ids as ``documents=`` (ring.py, ulysses.py): either this rank's part (b, T / cp),
cut like the tokens by `split_sequence`, which one all-gather reassembles, or the whole sequence's (b, T), the same on
every rank. The ring then masks each (query chunk, key chunk) block by both rules and skips a block no query of which
sees any of its keys (with short documents most blocks far from the diagonal); Ulysses gives its local attention the
(b, 1, T, T) mask.

HuggingFace decoders mark packing through ``position_ids`` alone: positions that restart (``DataCollatorWithFlattening``
gives ``0 1 2 0 1 0 1 2 3``) start a new document wherever a position is not the previous one plus 1, the rule of
transformers' ``find_packed_sequence_indices`` (`packed_documents`), which its eager and SDPA masks apply. Under
context parallel each rank holds only its chunks' positions, so the model's forward gathers them once
(`gather_sequence`) and files the documents found under the local tensor's identity (`file_documents`); every
attention call of that forward, and its recomputation under activation checkpointing, looks them up by the
``position_ids`` tensor it receives (`filed_documents`), and gathers again only for a tensor it was not given.
"""

from __future__ import annotations

import threading

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..comm.base import Communicator
from .split import SequenceSplit, gather_sequence, hidden_keys

__all__ = ["check_documents", "whole_documents", "packed_documents", "check_padding_mask", "padding_documents",
           "token_mask", "visibility", "chunk_local", "file_documents", "filed_documents", "NOT_FILED"]


def check_documents(documents: object, q: torch.Tensor, cp: int, who: str) -> torch.Tensor:
    """`documents` as given, after checking it: an integer tensor (b, L) of this rank's L tokens or (b, T = L cp)
    of the whole sequence, with b 1 or q's batch size; ValueError naming what is allowed otherwise."""
    B, L = q.shape[0], q.shape[2]
    if not isinstance(documents, torch.Tensor) or documents.dim() != 2 or documents.is_floating_point() \
            or documents.is_complex() or documents.dtype == torch.bool:
        got = (f"{documents.dtype} {tuple(documents.shape)}" if isinstance(documents, torch.Tensor)
               else type(documents).__name__)
        raise ValueError(f"{who}: documents must be an integer tensor (batch, tokens) of document ids, got {got}")
    if documents.shape[0] not in (1, B) or documents.shape[1] not in (L, L * cp):
        raise ValueError(f"{who}: documents of shape {tuple(documents.shape)} do not fit queries of shape "
                         f"{tuple(q.shape)}; allowed: ({B} or 1, {L}) for this rank's tokens or ({B} or 1, {L * cp}) "
                         f"for the whole sequence")
    return documents.to(q.device)


def whole_documents(documents: torch.Tensor, comm: Communicator, split: SequenceSplit, local_len: int
                    ) -> torch.Tensor:
    """The whole sequence's (b, T) document ids in sequence order: `documents` itself when it already spans T, else
    this rank's part gathered from every rank of `comm` (one all-gather; the ids are not differentiable)."""
    if documents.shape[1] == local_len * split.cp:  # the whole sequence already (always so under cp = 1)
        return documents
    return gather_sequence(documents, comm, zigzag=split.zigzag, dim=1)


def visibility(queries: torch.Tensor, keys: torch.Tensor, window: int | None,
               documents: torch.Tensor | None, causal: bool = True) -> torch.Tensor | None:
    """True where the key at global position ``keys[j]`` is hidden from the query at ``queries[i]``: (len(q),
    len(k)) by the causal rule and the window (`hidden_keys`; nothing for bidirectional attention, `causal`
    False), or (b, 1, len(q), len(k)) when `documents` (b, T) also hides keys of other documents. None when every
    key is visible."""
    hidden = hidden_keys(queries, keys, window, causal)
    if documents is not None:
        other = documents[:, queries].unsqueeze(-1) != documents[:, keys].unsqueeze(-2)
        if other.any():
            hidden = hidden.unsqueeze(0) | other
            return hidden.unsqueeze(1)
    return hidden if hidden.any() else None


def packed_documents(positions: torch.Tensor) -> torch.Tensor | None:
    """Document ids (b, T) from the whole sequence's position ids: a new document starts wherever a position is not
    the previous one plus 1 (transformers' ``find_packed_sequence_indices``); None when every row is one run."""
    start = positions[:, :1] - 1
    documents = (torch.diff(positions, prepend=start, dim=-1) != 1).cumsum(-1)
    return None if not documents[:, -1].any() else documents


def check_padding_mask(mask: object, batch: int, lengths: tuple[int, ...], where: str, who: str) -> torch.Tensor:
    """`mask` after checking it is a padding mask: an integer or bool tensor (batch, n), n one of `lengths` (`where`
    says what each is), holding 1 for a token and 0 for padding; ValueError naming what is allowed otherwise."""
    shapes = " or ".join(f"({batch}, {n})" for n in dict.fromkeys(lengths))
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.is_floating_point() or mask.is_complex() \
            or mask.shape[0] != batch or mask.shape[1] not in lengths:
        got = f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"{who}: attention_mask must be a padding mask, an integer or bool tensor {shapes} ({where}), "
                         f"1 for a token and 0 for padding; got {got}")
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError(f"{who}: attention_mask must be a padding mask {shapes} holding 1 (a token) and 0 (padding) "
                         f"only")
    return mask


def padding_documents(mask: torch.Tensor, comm: Communicator, split: SequenceSplit, local_len: int
                      ) -> torch.Tensor | None:
    """Document ids (B, T) from a padding mask (1 a token, 0 padding): this rank's (B, L) part, gathered from every
    rank of `comm` (one all-gather), or the whole sequence's (B, T). Real tokens share document 0; each padding token
    is a document of its own (-1 - its position), so it hides from every real token and sees only itself. None when
    nothing pads (decided on the whole mask: the same on every rank)."""
    whole = whole_documents(mask.long(), comm, split, local_len)
    if bool(whole.all()):
        return None
    lone = -1 - torch.arange(whole.shape[1], device=whole.device).expand_as(whole)
    return torch.where(whole.bool(), torch.zeros_like(lone), lone)



def token_mask(documents: torch.Tensor, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """The padding mask (1 a token, 0 padding) of document ids `padding_documents` made: padding's are negative."""
    return (documents >= 0).to(dtype)

def chunk_local(whole: torch.Tensor, split: SequenceSplit) -> bool:
    """Whether every rank gave 0..L-1 (positions counted within its own chunks, the usual mistake) rather than
    positions in the whole sequence: under cp > 1 these are never the positions of the sequence's tokens."""
    if split.cp == 1:
        return False
    L = whole.shape[1] // split.cp
    local = torch.arange(L, device=whole.device).repeat(split.cp)
    pattern = local.index_select(0, split.gather_order(L, whole.device))
    return bool((whole == pattern).all())


#: what `filed_documents` returns for a position tensor no forward filed
NOT_FILED = object()
_FILED: WeakIdKeyDictionary = WeakIdKeyDictionary()
_LOCK = threading.Lock()  # thread ranks file and look up at once


def file_documents(positions: torch.Tensor, documents: torch.Tensor | None) -> None:
    """Record the documents (None: one per row) that the position tensor `positions` marks, for as long as the
    tensor lives (the model's forward, and the backward that recomputes it)."""
    with _LOCK:
        _FILED[positions] = documents


def filed_documents(positions: torch.Tensor) -> object:
    """The documents filed for this very tensor (by identity), or NOT_FILED."""
    with _LOCK:
        return _FILED.get(positions, NOT_FILED)
