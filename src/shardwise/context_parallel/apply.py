"""`apply(model, cp_comm, method=...)`: make a model's attention context-parallel and its positions per chunk.

What changes, for the shardwise GPT (models/gpt.py):

* every ``CausalSelfAttention`` computes ``attend(q, k, v)`` with :func:`ring_attention` or
  :func:`ulysses_attention` over `cp_comm` instead of local causal attention (the class of each attention module is
  swapped for a subclass, as the tensor-parallel forward is; parameters and names are untouched);
* ``pos_emb`` reads the *global* positions of this rank's chunks (rows r*c..(r+1)*c-1 and (2cp-1-r)*c.. under
  zigzag) when the model asks for positions 0..L-1 of its L local tokens (its class is swapped the same way), so the
  GPT's own forward, unchanged, returns for ``model(x_chunk, y_chunk)`` on the tokens :func:`split_sequence` gave
  the mean loss over this rank's tokens, and ``pipeline_layers()`` stay the same computation.

For a HuggingFace decoder (Llama family: any model whose attention dispatches through transformers'
``AttentionInterface`` and takes ``position_ids``): the ring / Ulysses attention is registered as an attention
implementation and selected in the model's config, and the model's forward passes ``position_ids`` = the global
positions of this rank's tokens, so rotary embeddings rotate each token by its place in the whole sequence. Compute
the loss from the logits against targets already shifted (``split_sequence((x, y))``): HF's ``labels=`` shifts within
the chunk, which is wrong at chunk edges, so it is refused; so are padding masks (``attention_mask``): the attention
is causal over the whole sequence.

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

import dataclasses
from typing import Any

import torch
from torch import nn

from .. import layout
from .._mixin import mix_in
from ..comm.base import Communicator, is_communicator
from ..models.gpt import GPT, CausalSelfAttention
from .compose import METHODS, check_method, tensor_parallel_beneath
from .ring import ring_attention
from .split import SequenceSplit
from .ulysses import ulysses_attention

__all__ = ["apply", "ContextParallelState", "METHODS", "HF_ATTENTION"]

#: the name under which the attention is registered in transformers' AttentionInterface
HF_ATTENTION = "shardwise_context_parallel"


@dataclasses.dataclass(frozen=True)
class ContextParallelState:
    """What `apply` recorded on the model and its attention modules: the group, the method and the split;
    sequence_shards: the tensor-parallel size when sequence parallel splits each chunk over tp (else 1)."""

    comm: Communicator
    method: str
    zigzag: bool
    sequence_shards: int = 1

    @property
    def split(self) -> SequenceSplit:
        return SequenceSplit(self.comm.size, self.zigzag)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        fn = ring_attention if self.method == "ring" else ulysses_attention
        return fn(q, k, v, self.comm, zigzag=self.zigzag, scale=scale)

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        return self.split.positions(self.comm.rank, local_len, device)


def _state(obj: Any) -> ContextParallelState:
    return obj.__dict__["_shardwise_cp"]


def _set_state(obj: Any, state: ContextParallelState) -> None:
    object.__setattr__(obj, "_shardwise_cp", state)  # not a submodule or parameter: plain instance state


# ---- the shardwise GPT -------------------------------------------------------------------------------------------
class ContextParallelAttentionMixin:
    """``CausalSelfAttention.attend`` over the context-parallel group (ring or Ulysses)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _state(self).attend(q, k, v)


class ContextParallelPositionsMixin:
    """A position embedding read at this rank's global positions: ``pos_emb(arange(L))`` returns the rows of the
    positions of this rank's L tokens (split.py), so the GPT's own forward (and its pipeline stages) embed each
    token at its place in the whole sequence. Row i of the input means "this rank's i-th token". Under sequence
    parallel the tensor-parallel GPT asks for its 1/tp of the rows (compose.py): the chunk is tp times longer."""

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        state = _state(self)
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
            _set_state(module, state)
    mix_in(model.pos_emb, ContextParallelPositionsMixin, "ContextParallel")
    _set_state(model.pos_emb, state)


# ---- HuggingFace decoders ----------------------------------------------------------------------------------------
def _hf_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: (B, H, L, D) in, (B, L, H, D) out, no attention weights."""
    state = module.__dict__.get("_shardwise_cp")
    if state is None:
        raise ValueError(f"attention implementation {HF_ATTENTION!r} is used by {type(module).__name__}, which "
                         f"shardwise.context_parallel.apply did not prepare; apply it to the whole model")
    if attention_mask is not None:
        raise ValueError("context parallel attention is causal over the whole sequence; attention_mask (padding) "
                         "is not supported: pass attention_mask=None")
    if dropout:  # GPT-2 passes its attn_pdrop here in training mode: the blockwise attention has no dropout
        raise ValueError(f"context parallel attention: attention dropout {dropout} is not implemented by ring / "
                         f"Ulysses attention; allowed: 0.0 (e.g. GPT2Config(attn_pdrop=0.0), or eval())")
    window, length = kwargs.get("sliding_window"), query.shape[2] * state.comm.size
    if window is not None and length > window:  # a window at least as long as the sequence masks nothing
        raise ValueError(f"context parallel attention: sliding window {window} is shorter than the sequence length "
                         f"T={length}; ring / Ulysses attention has no sliding window: use sequences of at most "
                         f"{window} tokens, or cp=1")
    return state.attend(query, key, value, scale=scaling).transpose(1, 2).contiguous(), None


class ContextParallelHFMixin:
    """HF model forward with ``position_ids`` = the global positions of this rank's tokens (rotary offsets)."""

    def forward(self, input_ids: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> Any:
        if args:
            raise ValueError("context parallel HF model: pass the arguments after input_ids by keyword")
        if kwargs.get("labels") is not None:
            raise ValueError("context parallel HF model: labels= shifts targets within this rank's chunk, wrong at "
                             "chunk edges; compute the loss from .logits against split_sequence((x, y))'s targets")
        if kwargs.get("attention_mask") is not None:
            raise ValueError("context parallel HF model: attention_mask (padding) is not supported; pass None")
        ref = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
        if kwargs.get("position_ids") is None and ref is not None:
            state = _state(self)
            state.split.chunk_len(ref.shape[1], "context parallel HF model")
            kwargs["position_ids"] = state.positions(ref.shape[1], ref.device).unsqueeze(0).expand(ref.shape[0], -1)
        kwargs.setdefault("use_cache", False)  # no generation cache: a chunk is not a prefix of the sequence
        return super().forward(input_ids, **kwargs)


def _apply_hf(model: nn.Module, state: ContextParallelState) -> None:
    from transformers import AttentionInterface

    config = model.config
    for field in ("attention_dropout", "attn_pdrop"):  # Llama family; GPT-2
        if getattr(config, field, 0.0):
            raise ValueError(f"context_parallel.apply: {field}={getattr(config, field)} is not implemented by ring / "
                             f"Ulysses attention; allowed: 0.0")
    AttentionInterface.register(HF_ATTENTION, _hf_attention)
    config._attn_implementation = HF_ATTENTION
    attention = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
    if not attention:
        raise ValueError(f"context_parallel.apply: found no attention module (class name ending in 'Attention') in "
                         f"{type(model).__name__}")
    for module in attention:
        _set_state(module, state)
    mix_in(model, ContextParallelHFMixin, "ContextParallel")


def _is_hf(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


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
    elif _is_hf(model):
        _apply_hf(model, state)
    else:
        raise ValueError(f"context_parallel.apply: {type(model).__name__} is not supported; allowed: "
                         f"shardwise.models.GPT or a HuggingFace decoder whose attention uses AttentionInterface "
                         f"(Llama family); for other models call ring_attention / ulysses_attention in the attention")
    _set_state(model, state)
    # Parameters stay as they were (whole, or tensor-parallel slices) and gradients are reduced by the data-parallel
    # wrapper applied next, which declares its group; this record only says what was applied (comms=(): no gradient
    # reduction of its own to account for). Placements evaluated when asked (the parameters as they are then): expert
    # parallel, applied next in sw.parallelize's order, replaces the experts by their slices.
    layout.declare(model, layout.Parallelized(
        "context_parallel", comms=(),
        placements=beneath[-1].placements if beneath else (lambda: layout.base_placements(model)),
        options={"cp": comm.size, "method": method, "zigzag": zigzag}))
    return model
