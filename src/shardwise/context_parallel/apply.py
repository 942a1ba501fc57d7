"""`apply(model, cp_comm, method=...)`: make a model's attention context-parallel and its positions per chunk.

What changes, for the shardwise GPT (models/gpt.py):

* every ``CausalSelfAttention`` computes ``attend(q, k, v)`` with :func:`ring_attention` or
  :func:`ulysses_attention` over `cp_comm` instead of local causal attention (the class of each attention module is
  swapped for a subclass, as the tensor-parallel forward is; parameters and names are untouched);
* ``pos_emb`` reads the *global* positions of this rank's chunks (rows r*c..(r+1)*c-1 and (2cp-1-r)*c.. under
  zigzag) when the model asks for positions 0..L-1 of its L local tokens (its class is swapped the same way), so the
  GPT's own forward, unchanged, returns for ``model(x_chunk, y_chunk)`` on the tokens :func:`split_sequence` gave
  the mean loss over this rank's tokens, and ``pipeline_layers()`` stay the same computation.

For a HuggingFace decoder (any model whose attention dispatches through transformers' ``AttentionInterface``,
Llama family, GPT-2, Gemma, GPT-OSS, ...; hf.py): the ring / Ulysses attention is registered as an attention
implementation and selected in the model's config, and the model's forward passes ``position_ids`` = the global
positions of this rank's tokens. Compute the loss from the logits against targets already shifted
(``split_sequence((x, y))``); what the attention cannot make exact (padding masks, ``labels=``, encoders, attention
computed outside the interface, keywords it does not implement) is refused (hf.py).

Gradients. Each rank's loss is the mean over its T/cp tokens of every sequence (equal counts), and the ring's
backward already sends every rank its keys' and values' share of the other ranks' losses. What remains is to average
the parameter gradients over the group, which a data-parallel wrapper over a group containing `cp_comm` does: wrap
after this call, ``sw.DDP(model, cp_comm)`` (or over dp x cp ranks, as torchtitan shards over ``dp_shard_cp``).
Then the parameters step exactly as one process on the whole sequence.

Tensor parallel (compose.py). Apply it first (``tensor_parallel.parallelize(model, mesh.tp, plan)``, then this over
``mesh.cp``): the attention then holds n_heads / tp heads and the ring / Ulysses runs on those among the cp ranks of
the same tensor-parallel coordinate; the data-parallel wrapper goes over ``mesh.dp_cp``.

Refused at wrap time (ValueError): a model already wrapped by another strategy than tensor parallel (apply context
parallel first), a GPT or HF config with attention dropout (the blockwise attention has none), Ulysses with heads
(heads / tp under tensor parallel) not divisible by cp.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import layout
from .._mixin import mix_in
from ..comm.base import Communicator, is_communicator
from ..models.gpt import GPT, CausalSelfAttention
from .compose import METHODS, check_method, tensor_parallel_beneath
from .hf import HF_ATTENTION, apply_hf, is_hf
from .state import ContextParallelState, get_state, set_state

__all__ = ["apply", "ContextParallelState", "METHODS", "HF_ATTENTION"]


# ---- the shardwise GPT -------------------------------------------------------------------------------------------
class ContextParallelAttentionMixin:
    """``CausalSelfAttention.attend`` over the context-parallel group (ring or Ulysses)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return get_state(self).attend(q, k, v)


class ContextParallelPositionsMixin:
    """A position embedding read at this rank's global positions: ``pos_emb(arange(L))`` returns the rows of the
    positions of this rank's L tokens (split.py), so the GPT's own forward (and its pipeline stages) embed each
    token at its place in the whole sequence. Row i of the input means "this rank's i-th token". Under sequence
    parallel the tensor-parallel GPT asks for its 1/tp of the rows (compose.py): the chunk is tp times longer."""

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        state = get_state(self)
        local, cp_size = pos.shape[-1] * state.sequence_shards, state.comm.size
        if local * cp_size > self.num_embeddings:
            raise ValueError(f"sequence length T={local * cp_size} ({local} tokens on each of cp={cp_size} ranks) "
                             f"exceeds config.seq_len={self.num_embeddings}")
        state.split.chunk_len(local, "context parallel GPT")
        return super().forward(state.positions(local, pos.device)[pos])


def _apply_gpt(model: GPT, state: ContextParallelState) -> None:
    config = model.config
    if config.dropout:
        raise ValueError(f"context_parallel.apply: GPTConfig.dropout={config.dropout} also drops attention "
                         f"probabilities, which ring / Ulysses attention does not implement; allowed: 0.0")
    for module in model.modules():
        if isinstance(module, CausalSelfAttention):
            mix_in(module, ContextParallelAttentionMixin, "ContextParallel")
            set_state(module, state)
    mix_in(model.pos_emb, ContextParallelPositionsMixin, "ContextParallel")
    set_state(model.pos_emb, state)


def apply(model: nn.Module, comm: Communicator, *, method: str = "ring", zigzag: bool = True) -> nn.Module:
    """Make `model` (the shardwise GPT or a HuggingFace Llama-family decoder, plain or already tensor-parallel)
    context-parallel over `comm`, in place.

    method: "ring" (ring attention: any head count; K/V blocks passed around the ring) or "ulysses" (all-to-all
    over heads: n_heads, or n_heads / tp under tensor parallel, divisible by cp). zigzag: how the sequence is split
    (split.py); the same value must be given to :func:`split_sequence`. Feed each rank ``split_sequence((x, y),
    comm)`` and wrap with a data-parallel strategy over a group containing `comm` afterwards (see the module
    docstring). Returns the model.
    """
    if not is_communicator(comm):
        raise ValueError(f"context_parallel.apply: comm={comm!r} is not a Communicator (pass e.g. mesh.cp)")
    if not isinstance(zigzag, bool):
        raise ValueError(f"context_parallel.apply: zigzag={zigzag!r} must be a bool")
    beneath = layout.strategies(model)  # tensor parallel, or nothing (compose.py)
    tp, sequence_parallel = tensor_parallel_beneath(model, "context_parallel.apply")
    check_method(model, comm.size, method, tp=tp)
    state = ContextParallelState(comm, method, zigzag, tp if sequence_parallel else 1)
    if isinstance(model, GPT):
        _apply_gpt(model, state)
    elif is_hf(model):
        apply_hf(model, state)
    else:
        raise ValueError(f"context_parallel.apply: {type(model).__name__} is not supported; allowed: "
                         f"shardwise.models.GPT or a HuggingFace decoder whose attention uses AttentionInterface "
                         f"(Llama family); for other models call ring_attention / ulysses_attention in the attention")
    set_state(model, state)
    # Parameters stay as they were (whole, or tensor-parallel slices) and gradients are reduced by the data-parallel
    # wrapper applied next, which declares its group; this record only says what was applied (comms=(): no gradient
    # reduction of its own to account for). Placements evaluated when asked (the parameters as they are then): expert
    # parallel, applied next in sw.parallelize's order, replaces the experts by their slices.
    layout.declare(model, layout.Parallelized(
        "context_parallel", comms=(),
        placements=beneath[-1].placements if beneath else (lambda: layout.base_placements(model)),
        options={"cp": comm.size, "method": method, "zigzag": zigzag}))
    return model
