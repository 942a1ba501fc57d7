"""The loss of a rank under context parallel in a check: this rank's chunks of every sequence in, the whole
sequences' mean loss out, averaged over the cp ranks.

A context-parallel rank feeds its model the tokens `split_sequence` gives it (zigzag chunks r and 2cp-1-r of each
of its data-parallel rows), so the one-process loss cannot be computed as it is:

* a HuggingFace batch ``{"input_ids": ..., "labels": ...}``: HuggingFace's ``labels=`` shifts inside the chunk
  (refused by context parallel); the loss is instead `GlobalCausalLMLoss` (models/hf_parallel.py) of the chunk's
  logits against the whole labels, shifted over the whole sequence and divided by the label count over the dp
  ranks, whose mean over the dp x cp ranks is HuggingFace's over the global batch (padded rows included);
  a HuggingFace MoE's load-balancing loss is added as the model adds it (``router_aux_loss_coef x aux_loss``);
* a ``(x, y)`` batch for a model whose ``forward(x, y)`` returns the mean loss of its tokens (shardwise's GPT),
  targets already shifted: both are split alike, and every rank holds the same number of tokens, so the mean over
  the cp ranks is the mean over the sequence.

The check averages the ranks' losses over the data-parallel wrapper's group (dp x cp), which is then one process's
loss on the global batch. A `loss_fn` of the user's is refused under cp: how it weighs a chunk is its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..comm.base import Communicator

__all__ = ["chunked_loss", "packed_rows_note", "refuse_loss_fn"]


def refuse_loss_fn(loss_fn: object) -> None:
    if loss_fn is not None:
        raise ValueError("check: loss_fn cannot be combined with cp > 1: under context parallel the check computes "
                         "the loss of each rank's chunks itself (a HuggingFace {'input_ids', 'labels'} batch, or "
                         "(x, y) for a model whose forward(x, y) returns the mean loss); pass loss_fn=None")


def chunked_loss(dp: Communicator, cp: Communicator) -> Callable[[nn.Module, Any], torch.Tensor]:
    """The `loss_fn` of a context-parallel rank (module docstring) over the rows the check gave it."""
    from ..context_parallel import split_sequence
    from ..models.hf_parallel import GlobalCausalLMLoss

    chunk_loss = GlobalCausalLMLoss(dp, cp)

    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        if isinstance(batch, dict) and "labels" in batch:
            inputs = {k: split_sequence(v, cp) if isinstance(v, torch.Tensor) else v  # use_cache=False as it is
                      for k, v in batch.items() if k != "labels"}
            out = model(**inputs)
            chunk_loss.begin_step(batch["labels"], 1, batch)
            return chunk_loss(out.logits, batch["labels"]) + _router_loss(model, out)
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            out = model(*split_sequence(tuple(batch), cp))
            if isinstance(out, torch.Tensor) and out.dim() == 0:
                return out
        raise ValueError("check: under cp > 1 the batch must be a HuggingFace dict with 'input_ids' and 'labels', or "
                         "(x, y) for a model whose forward(x, y) returns the mean loss of its tokens")

    return loss


def _router_loss(model: nn.Module, out: Any) -> torch.Tensor | float:
    """What a HuggingFace MoE adds to its loss when given labels: ``router_aux_loss_coef x aux_loss`` (Mixtral and the
    models whose forward is its forward), 0 when the call returned no load-balancing loss. The data-parallel wrapper
    of the check (over dp x cp) made `aux_loss` the global batch's (experts/hf_aux.py), the same on every rank, so
    the mean over the cp ranks keeps it whole."""
    aux = getattr(out, "aux_loss", None)
    if aux is None:
        return 0.0
    coef = getattr(model, "router_aux_loss_coef", None)
    if coef is None:
        raise ValueError(f"check: under cp > 1 {type(model).__name__} returned an aux_loss but has no "
                         f"router_aux_loss_coef, so the check cannot tell how it enters the loss; pass "
                         f"output_router_logits=False or check without cp")
    return coef * aux


def packed_rows_note(batch: Any, build_model: Callable[[], nn.Module] | None = None) -> str | None:
    """Why a HuggingFace batch of packed rows (position ids restarting at each document) may differ at step 0:
    transformers keeps one process's documents apart (eager and SDPA attention) only when no cache is in use
    (``use_cache`` not False is the default of most configs) and only in a model whose forward gives its mask function
    the position ids (hf_packing.py: GPT-OSS, AFMoE, Falcon and OPT do not), while context parallel and pipeline
    stages keep them apart. `build_model` builds a copy of the model to read that from. None for other batches."""
    if not (isinstance(batch, dict) and isinstance(batch.get("position_ids"), torch.Tensor)):
        return None
    positions = batch["position_ids"]
    restarts = positions.dim() == 2 and bool((torch.diff(positions, dim=-1) != 1).any())
    if not restarts:
        return None
    if batch.get("use_cache") is not False:
        return ("the batch packs documents (its position_ids restart) without use_cache=False: transformers then lets "
                "one process's documents attend to each other (it keeps them apart from the positions only when no "
                "cache is in use), while the strategy keeps them apart; add 'use_cache': False to the batch")
    from ..hf_packing import mask_without_positions

    where = mask_without_positions(build_model()) if build_model is not None else None
    if where is None:
        return None
    return (f"the batch packs documents (its position_ids restart) and {where} builds its causal mask without the "
            f"position ids: with eager and SDPA attention one process lets the documents of a row attend to each "
            f"other, while the strategy keeps them apart, as transformers does under flash attention "
            f"(docs/context_parallel.md, 'Packed sequences'); check this model with rows of one sequence each")
