"""HuggingFace decoder models as pipeline layers: one tensor in, one tensor out, holding the model's own modules.

``transformers`` decoders run their layers inside one ``forward`` that builds, once, what every layer needs
besides the hidden states: the causal attention mask (``create_causal_mask``), the position ids and, for Llama,
the rotary ``(cos, sin)``. A pipeline stage only receives the previous stage's tensor, so here each decoder-layer
stage rebuilds those from the hidden states it receives (B, T, d) -- position ids ``arange(T)``, an explicit
causal mask, the rotary embeddings from the model's own ``rotary_emb`` module -- and calls the HuggingFace layer
with them. The lists are ``[embedding, *decoder layers, head]``, the same shape as the GPT's ``pipeline_layers()``,
for ``shardwise.pipeline.partition``:

    stages = pp.partition(llama_pipeline_layers(model), n_stages=4)
    pipe = pp.Pipeline(stages, comm, "1f1b", n_microbatches=8, loss_fn=causal_lm_loss)

The stages reference the modules the model holds when the list is built (no copies), so training them trains the
model and its ``state_dict`` names stay valid; build the list after ``tensor_parallel.parallelize`` (which
replaces modules in place) and the stages run the tensor-parallel layers. GPT-2-shaped families (GPT-2, GPT-BigCode,
GPT-Neo, GPT-J, CodeGen) have stages of their own, hf_gpt2_stages.py. GPT-2's ``lm_head`` is tied to ``wte``:
the first and last stage hold one Parameter, which ``Pipeline`` keeps in sync across ranks by identity.

The mask (what the installed transformers 5.x expects, checked by the tests against the model's own logits): an
additive float mask (B, 1, T, T), 0 where a query may attend and ``finfo(dtype).min`` elsewhere, in the hidden
states' dtype. The ``"eager"`` attention adds it to the scores; it is exactly the mask HuggingFace builds for eager
(a bool mask would be added as 0/1, and None would not mask at all). ``"sdpa"`` passes it to
``scaled_dot_product_attention`` as ``attn_mask`` (HuggingFace itself passes None with ``is_causal=True``; the
results are equal). Other implementations (flash attention, flex attention) expect something else and are
rejected with a ValueError. A sliding-window layer (Mistral's ``sliding_window``; Qwen2's ``layer_types``) also
masks keys ``window`` or more positions back, as HuggingFace's sliding-window mask does.

Context parallel (``cp=``, the group ``shardwise.context_parallel.apply`` made the model's attention context-parallel
over): each rank holds chunks of every sequence (``split_sequence``'s zigzag split), so the stages give the layers
the *global* positions of those tokens (rotary angles and GPT-2's position embeddings of their places in the whole
sequence) and no mask: the ring / Ulysses attention is causal over the whole sequence itself, and applies the sliding
window the layer's attention passes it. The loss of such stages is in hf_parallel.py:
labels are shifted over the whole sequence before they are cut, so no label crosses a chunk edge.

Packed rows (several documents per row, marked by ``position_ids`` that restart at each document, as
``DataCollatorWithFlattening`` gives them): give the first stage ``(input_ids, position_ids)`` (a dict with those
keys, or a tuple) and every stage passes the positions on beside the hidden states, ``(hidden, position_ids)``, to the
next (an integer leaf of the pipeline's messages, without gradient). The layers then rotate by those positions (GPT-2
embeds them) and keep documents apart by transformers' rule (a new document wherever a position is not the previous
plus 1, ``find_packed_sequence_indices``): a block-diagonal causal mask (b, 1, T, T), built once per microbatch and
window; under context parallel the ring / Ulysses attention finds the documents from the positions itself
(context_parallel/documents.py). transformers' own eager and SDPA masks apply this rule only when no cache is in use
(``use_cache=False``); the stages apply it always. Padded rows: give the first stage ``attention_mask`` (1 a token, 0
padding) too; it makes the padding documents of their own (each token one) and passes those ids on as ``documents``
(the stages then take and return a dict), which every decoder stage masks by (`hf_stage_inputs.padding_of`).

``causal_lm_loss`` is HuggingFace's ``ForCausalLMLoss``: logits at position t predict label t + 1, -100 labels are
ignored, the mean is over the remaining tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.base import Communicator
from .hf_families import (HeadInput, LogitsOutput, embedding_dropout, embedding_multiplier, layer_arguments,
                          layer_rotary, module_paths, normed_embeddings, pipeline_kinds, rotary_layer_type)
from .hf_stage_inputs import (SUPPORTED_ATTENTION, CausalMasks, StagePositions, check_attention, check_ids,
                              given_positions, layer_inputs, packed_layer, padding_of, passed_on, submodule)

__all__ = [
    "SUPPORTED_ATTENTION",
    "HFHeadStage",
    "LlamaDecoderStage",
    "LlamaEmbeddingStage",
    "causal_lm_loss",
    "llama_pipeline_layers",
    "shifted_labels",
]

IGNORE_INDEX = -100


class LlamaEmbeddingStage(nn.Module):
    """First stage of a Llama-style model: ``embed_tokens(input_ids)``, (B, T) int -> (B, T, d); times `multiplier`
    when given (Granite's ``embedding_multiplier``); then dropout with probability `dropout` in training, as
    StarCoder2's forward drops out the embeddings (``embedding_dropout``); then `norm` when given (nanochat's final
    norm, which its forward applies before the layers too)."""

    def __init__(self, embed_tokens: nn.Module, positions: StagePositions | None = None, dropout: float = 0.0,
                 multiplier: float | None = None, norm: nn.Module | None = None) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self._positions = positions if positions is not None else StagePositions()
        self.dropout = float(dropout)
        self.multiplier = multiplier
        self.norm = norm

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> Any:
        who = "LlamaEmbeddingStage"
        check_ids(input_ids, who)
        hidden = self.embed_tokens(input_ids)
        if self.multiplier is not None:
            hidden = hidden * self.multiplier
        if self.dropout:
            hidden = F.dropout(hidden, p=self.dropout, training=self.training)
        if self.norm is not None:
            hidden = self.norm(hidden)
        return passed_on(hidden, given_positions(position_ids, input_ids, who),
                         padding_of(attention_mask, input_ids, self._positions, who))


class LlamaDecoderStage(nn.Module):
    """One Llama-style decoder layer as a stage: hidden (B, T, d) -> hidden (B, T, d).

    Builds what ``LlamaModel.forward`` builds once for all layers: position ids ``arange(T)`` (under context
    parallel the global positions of this rank's chunks), the rotary
    ``(cos, sin)`` from the model's own ``rotary_emb`` (a module without parameters, shared by every decoder
    stage; of the layer's type `rotary_type` when given: hf_families.rotary_layer_type), and the additive causal
    mask (sliding-window when ``window`` is set; none under context parallel); then calls ``layer`` with them.

    chunk: the layer attends within chunks of that many tokens (Llama 4's chunked-attention layers,
    ``attention_chunk_size``): its mask hides the keys of other chunks too (hf_stage_inputs.CausalMasks).

    recurrent: the layer mixes tokens by a linear-attention recurrence (Qwen3-Next's and Qwen3.5's gated DeltaNet
    layers, ``layer_types`` "linear_attention"), which is causal by itself: it takes, as transformers'
    ``create_recurrent_attention_mask`` gives it, the 2-D padding mask (1 a token, 0 padding: the padding's inputs
    zeroed so they do not enter the recurrence) or None. Packed rows raise: the recurrence would run from one
    document into the next.
    """

    def __init__(self, layer: nn.Module, rotary_emb: nn.Module, config: object, window: int | None,
                 masks: CausalMasks, rotary_type: str | None = None, recurrent: bool = False,
                 chunk: int | None = None, arguments: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.arguments = dict(arguments or {})  # the family's own (hf_families.layer_arguments: Falcon's alibi=None)
        self.rotary_emb = rotary_emb
        self.config = config
        self.window = window
        self._masks = masks
        self.rotary_type = rotary_type
        self.recurrent = recurrent
        self.chunk = chunk
        # > 1: the hidden states come as sequence shards of that many ranks (tensor_parallel/hf_sequence.py: every
        # layer after the first), and the mask and positions are those of the whole sequence the attention gathers
        self.sequence_split = 1

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> Any:
        who = "LlamaDecoderStage"
        whole = hidden
        if self.sequence_split > 1:  # what the mask and positions read of it: its shape, dtype and device
            B, T, d = hidden.shape
            whole = hidden.new_empty(1, 1, 1).expand(B, T * self.sequence_split, d)
        given, positions, documents = layer_inputs(self.config, self._masks, whole, position_ids, documents, who)
        mask = self._recurrent_mask(given, documents) if self.recurrent else \
            self._masks(whole, self.window, who, given, documents, self.chunk)
        with packed_layer(self.layer, self._masks.positions, given, documents):
            out = self.layer(hidden, attention_mask=mask, position_ids=positions,
                             position_embeddings=self._rotary(whole, positions), **self.arguments)
        # Older transformers returned a 1-tuple (hidden,); 5.x returns the tensor.
        return passed_on(out[0] if isinstance(out, tuple) else out, given, documents)

    def _recurrent_mask(self, given: torch.Tensor | None, documents: torch.Tensor | None) -> torch.Tensor | None:
        if given is not None:
            raise ValueError(f"LlamaDecoderStage: packed rows (position_ids) reach {type(self.layer).__name__}, a "
                             f"linear-attention layer, whose recurrence would run from one document into the next "
                             f"(transformers' own forward does too, without its flash-linear-attention kernels); "
                             f"give rows of one sequence each, padded with an attention_mask")
        from ..context_parallel.documents import token_mask

        return None if documents is None else token_mask(documents)  # multiplying by 1 leaves a token as it is

    def _rotary(self, hidden: torch.Tensor, positions: torch.Tensor) -> Any:
        if self.rotary_emb is None:  # a layer without rotary embeddings (Granite SWA's base 0)
            return None
        if self.rotary_type is None:
            return self.rotary_emb(hidden, positions)
        return self.rotary_emb(hidden, positions, self.rotary_type)

    def extra_repr(self) -> str:
        return "recurrent" if self.recurrent else f"chunk={self.chunk}" if self.chunk else f"window={self.window}"


class HFHeadStage(nn.Module):
    """Last stage: ``lm_head(norm(hidden))``, (B, T, d) -> logits (B, T, V) (Llama's RMSNorm, GPT-2's ln_f), then
    `output` of them when given (a family's logit scale or soft cap: hf_families.LogitsOutput); `head_input` of the
    normed hidden states before ``lm_head`` when given (MiniCPM3's division: hf_families.HeadInput)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module,
                 output: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 head_input: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head
        self.output = output
        self.head_input = head_input

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.norm(hidden)  # packed rows' positions and padded rows' documents end here
        logits = self.lm_head(hidden if self.head_input is None else self.head_input(hidden))
        return logits if self.output is None else self.output(logits)


def _layer_rules(config: object, index: int, who: str) -> dict[str, Any]:
    """How decoder layer `index` mixes tokens, as the HF model decides it by its layer type (LlamaDecoderStage's
    `window`, `chunk` and `recurrent`): full causal attention, a sliding window (Mistral applies
    config.sliding_window to every layer; typed layers "sliding_attention"), Llama 4's chunks ("chunked_attention")
    or a linear-attention recurrence ("linear_attention"); DeepSeek-V3.2's "indexed_attention" takes the causal mask
    (its indexer picks each query's keys under it). ValueError for another layer type."""
    rules: dict[str, Any] = {"window": None, "chunk": None, "recurrent": False}
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return {**rules, "window": getattr(config, "sliding_window", None)}
    kind = layer_types[index]
    if kind == "sliding_attention":
        return {**rules, "window": config.sliding_window}
    if kind == "chunked_attention":
        return {**rules, "chunk": int(config.attention_chunk_size)}
    if kind == "linear_attention":
        return {**rules, "recurrent": True}
    if kind in ("full_attention", "indexed_attention"):  # DeepSeek-V3.2's indexer selects keys under the causal mask
        return rules
    raise ValueError(f"{who}: decoder layer {index} has layer type {kind!r}; supported 'full_attention', "
                     f"'indexed_attention', 'sliding_attention', 'chunked_attention' and 'linear_attention'")


def llama_pipeline_layers(model: nn.Module, *, cp: Communicator | None = None, zigzag: bool = True
                          ) -> list[nn.Module]:
    """``[LlamaEmbeddingStage, LlamaDecoderStage per layer, HFHeadStage]`` for a Llama-style causal LM.

    `model` is a ``transformers.LlamaForCausalLM`` or a model of the same structure (hf_families.LLAMA_SHAPED, and
    the families generated from them: hf_families.pipeline_kinds):
    ``model.model.embed_tokens``, ``.layers``, ``.norm``, ``.rotary_emb`` and ``model.lm_head`` (or the family's own
    names: hf_families.module_paths). The stages hold
    those modules (no copies); applying them in order to input_ids (B, T) gives ``model(input_ids).logits``.
    Raises ValueError naming what is missing for another structure, and for an attention implementation other
    than eager or sdpa.

    cp: the context-parallel group of a model prepared by ``shardwise.context_parallel.apply(model, cp)``; the
    stages then take this rank's chunks of every sequence (``split_sequence(x, cp, zigzag=zigzag)``) and give each
    token its global position, with no mask (module docstring). Mixtral (same structure, fused experts) works too.
    """
    who = "llama_pipeline_layers"
    expected = "a Llama-style causal LM (model.model.embed_tokens, .layers, .norm, .rotary_emb; model.lm_head)"
    base, head = pipeline_kinds(model) or (None, None)  # a family generated from a listed one: that one's extras
    parts = {name: submodule(model, path, who, expected) for name, path in module_paths(model, base).items()}
    config = model.config
    masks = CausalMasks(StagePositions(cp, zigzag))
    check_attention(config, who, masks.positions)
    # HuggingFace runs layers[:num_hidden_layers]; a longer list (e.g. extra MTP layers) is not part of forward.
    layers = list(parts["layers"])[: config.num_hidden_layers]
    rotary = parts.get("rotary_emb")  # None: the family's layers take no rotary embeddings (Kimi-Linear)
    return [
        LlamaEmbeddingStage(parts["embed_tokens"], masks.positions, embedding_dropout(model, base),
                            embedding_multiplier(model, base), parts["norm"] if normed_embeddings(base) else None),
        *(LlamaDecoderStage(layer, layer_rotary(model, base, i, rotary), config, masks=masks,
                            rotary_type=rotary_layer_type(rotary, config, i) if rotary is not None else None,
                            arguments=layer_arguments(model, base), **_layer_rules(config, i, who))
          for i, layer in enumerate(layers)),
        HFHeadStage(parts["norm"], parts["lm_head"], LogitsOutput(model, head), HeadInput(model, head)),
    ]


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """HuggingFace's causal-LM loss: mean cross entropy of logits (B, T, V) at t against labels (B, T) at t + 1.

    ``causal_lm_loss(logits, input_ids)`` equals ``model(input_ids, labels=input_ids).loss``: the labels are
    shifted left by one inside (the last position predicts nothing), labels equal to -100 are ignored, and the mean
    is over the remaining tokens. Half-precision logits are upcast to float32 as HuggingFace does; float64 stays
    float64 (HuggingFace's ``logits.float()`` would round it to float32). As a pipeline ``loss_fn`` the step's
    loss is the mean of the microbatch means, which is HuggingFace's whole-batch mean when every microbatch has
    the same number of labels that are not -100 (always, without -100 labels).
    """
    if logits.dim() < 2 or logits.shape[:-1] != labels.shape:
        raise ValueError(f"causal_lm_loss: labels shape {tuple(labels.shape)} does not match logits shape "
                         f"{tuple(logits.shape)} minus the vocabulary dim")
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    shifted = shifted_labels(labels).to(logits.device)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=IGNORE_INDEX)


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """HuggingFace's causal-LM targets: `labels` shifted left by one along the last dim, the last position -100
    (it predicts nothing)."""
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)
