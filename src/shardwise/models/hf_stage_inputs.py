"""What each HuggingFace decoder stage rebuilds from the tensors it receives: the tokens' position ids and the additive
causal mask (hf_stages.py), and the checks of what a stage is given.

`StagePositions` gives the position ids of a stage's tokens: ``arange(T)``; under context parallel the global positions
of this rank's chunks; for packed rows the positions the stage received (`given_positions`), which `passed_on` hands
to the next stage beside the hidden states. `CausalMasks` builds the additive masks HuggingFace's eager and SDPA
attention take -- causal, sliding-window, and for packed rows block-diagonal by document (context_parallel/documents.py
has the rule) -- once per shape, or once per microbatch of packed rows, and none under context parallel.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

from torch import nn

import torch

from ..comm.base import Communicator, is_communicator

__all__ = ["SUPPORTED_ATTENTION", "CausalMasks", "StagePositions", "check_attention", "check_hidden", "check_ids",
           "given_positions", "layer_inputs", "packed_layer", "padding_of", "passed_on", "stage_documents", "submodule"]


def check_ids(ids: torch.Tensor, who: str, max_positions: int | None = None) -> None:
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point() or ids.is_complex():
        got = f"{ids.dtype} {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"{who}: input_ids must be an integer tensor of shape (B, T), got {got}")
    if max_positions is not None and ids.shape[1] > max_positions:
        raise ValueError(f"{who}: sequence length T={ids.shape[1]} exceeds the model's {max_positions} positions")


def check_hidden(hidden: torch.Tensor, who: str) -> None:
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or not hidden.is_floating_point():
        got = f"{hidden.dtype} {tuple(hidden.shape)}" if isinstance(hidden, torch.Tensor) else type(hidden).__name__
        raise ValueError(f"{who}: expected hidden states of shape (B, T, d), got {got}")


def given_positions(positions: object, ref: torch.Tensor, who: str) -> torch.Tensor | None:
    """Packed rows' position ids as a stage receives them (None: none given), after checking they fit `ref`'s
    (B, T) tokens: an integer tensor (B, T)."""
    if positions is None:
        return None
    B, T = ref.shape[:2]
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2 or positions.is_floating_point() \
            or positions.is_complex() or positions.dtype == torch.bool or tuple(positions.shape) != (B, T):
        got = (f"{positions.dtype} {tuple(positions.shape)}" if isinstance(positions, torch.Tensor)
               else type(positions).__name__)
        raise ValueError(f"{who}: position_ids must be an integer tensor ({B}, {T}) like the tokens, got {got}")
    return positions


def passed_on(hidden: torch.Tensor, positions: torch.Tensor | None, documents: torch.Tensor | None = None) -> Any:
    """What a stage gives the next one: the hidden states, and beside them packed rows' positions when given, and
    padded rows' documents (a dict then, the next stage's keyword arguments)."""
    if documents is None:
        return hidden if positions is None else (hidden, positions)
    out = {"hidden": hidden, "documents": documents}
    if positions is not None:
        out["position_ids"] = positions
    return out


def padding_of(mask: object, ids: torch.Tensor, positions: StagePositions, who: str) -> torch.Tensor | None:
    """The first stage's padding mask (B, L) as the whole sequence's documents (B, T): each padding token a document
    of its own (context_parallel/documents.py, `padding_documents`; under context parallel gathered over the group
    once per microbatch); None without a mask. A microbatch the mask does not pad gets one document per row: every
    microbatch of a step must hand the next stage the same structure (a pipeline refuses one that changes), and a
    batch may pad some rows only. ValueError naming what is allowed for another mask."""
    if mask is None:
        return None
    from ..context_parallel.documents import check_padding_mask, padding_documents
    from ..context_parallel.split import SequenceSplit

    B, L = ids.shape[:2]
    mask = check_padding_mask(mask, B, (L,), "the tokens' shape", who)
    split = SequenceSplit(positions.cp.size if positions.cp is not None else 1, positions.zigzag)
    documents = padding_documents(mask, positions.cp, split, L)
    return documents if documents is not None else torch.zeros(B, L * split.cp, dtype=torch.long, device=ids.device)


def stage_documents(documents: object, hidden: torch.Tensor, positions: torch.Tensor, stage: StagePositions,
                    who: str) -> torch.Tensor | None:
    """Padded rows' documents as a decoder stage receives them (None: none), checked against its hidden states;
    under context parallel filed under the position tensor its attention receives (documents.py)."""
    if documents is None:
        return None
    B, T = hidden.shape[0], stage.global_length(hidden.shape[1])
    if not isinstance(documents, torch.Tensor) or documents.is_floating_point() or tuple(documents.shape) != (B, T):
        raise ValueError(f"{who}: documents must be the integer ids ({B}, {T}) the first stage made of the padding")
    if stage.cp is not None:
        from ..context_parallel.documents import file_documents

        file_documents(positions, documents)
    return documents


def packed_layer(layer: nn.Module, positions: StagePositions, given: torch.Tensor | None,
                 documents: torch.Tensor | None = None) -> contextlib.AbstractContextManager:
    """Where a stage calls `layer` with packed rows' positions or padded rows' documents under context parallel: its
    attention must receive the position ids the documents are filed under (context_parallel.hf.packed_rows), or it
    would attend across the documents or to the padding."""
    if (given is None and documents is None) or positions.cp is None:
        return contextlib.nullcontext()
    from ..context_parallel.hf import packed_rows

    return packed_rows(layer, padded=documents is not None)


class StagePositions:
    """The position ids of the T tokens a stage receives, (1, T) (broadcast over the batch, as HuggingFace's own
    forward builds them without a cache): ``arange(T)`` for whole sequences; under context parallel (`cp`, a group
    of ranks each holding chunks of every sequence) the global positions of this rank's chunks (split.py)."""

    def __init__(self, cp: Communicator | None = None, zigzag: bool = True) -> None:
        if cp is not None and not is_communicator(cp):
            raise ValueError(f"pipeline layers: cp={cp!r} must be a Communicator (mesh.cp) or None")
        self.cp = cp if cp is not None and cp.size > 1 else None
        self.zigzag = zigzag

    def global_length(self, local: int) -> int:
        return local * (self.cp.size if self.cp is not None else 1)

    def __call__(self, hidden: torch.Tensor, given: torch.Tensor | None = None) -> torch.Tensor:
        T = hidden.shape[1]
        if given is not None:  # packed rows' positions, this rank's part of them under cp (checked by the stage)
            return given
        if self.cp is None:
            return torch.arange(T, device=hidden.device).unsqueeze(0)
        from ..context_parallel.documents import file_documents
        from ..context_parallel.split import SequenceSplit

        positions = SequenceSplit(self.cp.size, self.zigzag).positions(self.cp.rank, T, hidden.device).unsqueeze(0)
        file_documents(positions, None)  # one sequence per row: the attention need not gather these to find out
        return positions


def _ref(tensor: torch.Tensor | None) -> Any:
    """A weak reference to `tensor`, or for None a callable returning None (so `ref() is tensor` holds either way)."""
    return weakref.ref(tensor) if tensor is not None else lambda: None


class CausalMasks:
    """The additive causal masks of one model's decoder stages, built once per (T, window, dtype, device) (for packed
    rows once per microbatch's position tensor and window), and the stages' position ids (`positions`).

    Shared by the stages of one ``*_pipeline_layers`` call (a plain object, not a module: it holds no state to
    save or move). Only the latest mask per window is kept, so varying sequence lengths do not accumulate masks;
    reusing one tensor also means an attention kernel that saves its mask for backward keeps one copy, not one
    per layer and microbatch. Under context parallel there is no mask (None): the attention is causal over the
    whole sequence by itself.
    """

    def __init__(self, positions: StagePositions) -> None:
        self._latest: dict[int | None, tuple[tuple, torch.Tensor]] = {}
        self._packed: dict[int | None, tuple[weakref.ref, tuple, torch.Tensor | None]] = {}
        self._chunks: dict[tuple, tuple[Any, Any, torch.Tensor]] = {}
        self.positions = positions

    def __call__(self, hidden: torch.Tensor, window: int | None, who: str,
                 packed: torch.Tensor | None = None, documents: torch.Tensor | None = None,
                 chunk: int | None = None) -> torch.Tensor | None:
        B, T = hidden.shape[:2]
        if self.positions.cp is not None:  # ring / Ulysses attention masks causally (and by the window) itself
            return None
        if chunk is not None:
            return self._chunked(hidden, chunk, who, packed, documents)
        if documents is not None or packed is not None:  # padding's documents, as transformers, before packing's
            mask = self._documents_mask(hidden, window, documents if documents is not None else packed,
                                        documents is None)
            if mask is not None:
                return mask
        key = (T, hidden.dtype, hidden.device)
        hit = self._latest.get(window)
        if hit is None or hit[0] != key:
            from ..context_parallel.split import hidden_keys

            positions = torch.arange(T, device=hidden.device)
            zero = torch.zeros((), dtype=hidden.dtype, device=hidden.device)
            blocked = hidden_keys(positions, positions, window)
            mask = torch.where(blocked, torch.finfo(hidden.dtype).min, zero).view(1, 1, T, T)
            hit = self._latest[window] = (key, mask)
        return hit[1].expand(B, 1, T, T)

    def _chunked(self, hidden: torch.Tensor, chunk: int, who: str, packed: torch.Tensor | None,
                 documents: torch.Tensor | None) -> torch.Tensor:
        """The mask of a chunked-attention layer (Llama 4's ``attention_chunk_size``): the causal mask (by document,
        as `__call__` builds it) with every key of another chunk hidden too. Chunks are counted as transformers'
        ``create_chunked_causal_mask`` counts them: from each row's first token after its left padding, or for packed
        rows (no padding mask) from each document's start, by its position ids. Kept for the latest (documents,
        packed positions) pair, by identity, as the documents' masks are."""
        key = (hidden.shape[1], hidden.dtype, hidden.device, chunk)
        hit = self._chunks.get(key)
        if hit is None or hit[0]() is not documents or hit[1]() is not packed:
            T = hidden.shape[1]
            causal = self(hidden[:1] if documents is None and packed is None else hidden, None, who, packed, documents)
            where = torch.arange(T, device=hidden.device).unsqueeze(0)
            if documents is not None:  # (a padding mask replaces what packed positions would say, as in transformers)
                from ..context_parallel.documents import token_mask

                where = where - (token_mask(documents).cumsum(-1) == 0).sum(-1, keepdim=True).to(hidden.device)
            elif packed is not None:
                where = packed.to(hidden.device)
            place = torch.div(where, chunk, rounding_mode="floor")  # (b, T): the chunk of each token
            other = (place.unsqueeze(-1) != place.unsqueeze(-2)).unsqueeze(1)  # (b, 1, T, T)
            mask = causal.masked_fill(other, torch.finfo(hidden.dtype).min)
            hit = self._chunks[key] = (_ref(documents), _ref(packed), mask)
        mask = hit[2]
        return mask.expand(hidden.shape[0], *mask.shape[1:])

    def _documents_mask(self, hidden: torch.Tensor, window: int | None, marks: torch.Tensor, from_positions: bool
                        ) -> torch.Tensor | None:
        """The additive mask (b, 1, T, T) keeping apart the documents `marks` gives (packed positions, or padded
        rows' document ids), None for rows of one sequence each; kept for the latest tensor (by identity: the one
        every layer of a stage receives for a microbatch, and activation checkpointing's recomputation)."""
        from ..context_parallel.documents import packed_documents, visibility

        key = (hidden.dtype, hidden.device)
        hit = self._packed.get(window)
        if hit is None or hit[0]() is not marks or hit[1] != key:
            documents = packed_documents(marks) if from_positions else marks
            mask = None
            if documents is not None:
                where = torch.arange(hidden.shape[1], device=hidden.device)
                hidden_keys = visibility(where, where, window, documents.to(hidden.device))
                zero = torch.zeros((), dtype=hidden.dtype, device=hidden.device)
                mask = torch.where(hidden_keys, torch.finfo(hidden.dtype).min, zero)
                if mask.dim() == 2:  # one document per row (a microbatch nothing pads): the causal rule alone
                    mask = mask.view(1, 1, *mask.shape)
            hit = self._packed[window] = (weakref.ref(marks), key, mask)
        mask = hit[2]
        return None if mask is None else mask.expand(hidden.shape[0], *mask.shape[1:])


SUPPORTED_ATTENTION = ("eager", "sdpa")  # the stages pass an explicit additive mask


def check_attention(config: object, who: str, positions: StagePositions | None = None) -> None:
    from ..context_parallel.apply import HF_ATTENTION

    impl = getattr(config, "_attn_implementation", None)
    if positions is not None and positions.cp is not None:
        if impl != HF_ATTENTION:
            raise ValueError(f"{who}: cp is given but the model's attention implementation is {impl!r}, not context "
                             f"parallel's {HF_ATTENTION!r}; call shardwise.context_parallel.apply(model, cp) first")
        return
    if impl == HF_ATTENTION:
        raise ValueError(f"{who}: the model's attention is context parallel ({impl!r}, from "
                         f"shardwise.context_parallel.apply): pass its group as cp= so the stages give each token its "
                         f"global position and no chunk-local causal mask")
    if impl not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"{who}: attention implementation {impl!r} is not supported; allowed {list(SUPPORTED_ATTENTION)} (the "
            f"stages pass an explicit additive causal mask), e.g. model.set_attn_implementation('sdpa')"
        )


def layer_inputs(config: object, masks: CausalMasks, hidden: torch.Tensor, position_ids: object, documents: object,
                  who: str) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """What a decoder-layer stage checks and rebuilds before calling its layer: (packed rows' positions as received,
    or None; the positions the layer rotates or embeds by; padded rows' documents, or None)."""
    check_hidden(hidden, who)
    # Read at call time: set_attn_implementation may switch it after the stages were built.
    check_attention(config, who, masks.positions)
    given = given_positions(position_ids, hidden, who)
    positions = masks.positions(hidden, given)
    return given, positions, stage_documents(documents, hidden, positions, masks.positions, who)


def submodule(model: nn.Module, path: str, who: str, expected: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise ValueError(f"{who}: {type(model).__name__} has no module {path!r}; expected {expected}") from None
