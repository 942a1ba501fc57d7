"""HuggingFace decoders under context parallel: ring / Ulysses attention as a transformers attention function.

transformers' decoders (Llama, Qwen, Mistral, Gemma, GPT-2, GPT-OSS, ...) call their attention through
``AttentionInterface``: the function named by ``config._attn_implementation`` receives (B, H, L, D) queries, keys and
values after rotary embedding, plus keywords for what the model's attention does besides softmax(q k^T) v. `apply_hf`
registers :func:`hf_attention` under :data:`HF_ATTENTION`, selects it in the model's config, and makes the model's
forward pass ``position_ids`` = the global positions of this rank's tokens, so rotary embeddings rotate each token by
its place in the whole sequence. Given ``position_ids`` must be the whole sequence's cut like the tokens: packed
documents' positions (restarting at each document) make the attention keep the documents apart (documents.py), and
positions 0..L-1 on every rank (counted within each rank's chunks) are refused.

What the attention function does with each keyword: ``scaling`` scales q k^T; ``softcap`` (Gemma 2's
``attn_logit_softcapping``) caps the scores as ``softcap * tanh(s / softcap)``; ``s_aux`` (GPT-OSS's per-head
``sinks``) adds one logit per head to every softmax denominator; ``sliding_window`` limits how far back a query sees
(from the keyword, or the module or config where a model windows through its mask alone: `_window`). Keywords that do
not change the result (``position_ids``, ``use_cache``, ...) pass; any other keyword with a value is refused by
name at the first forward, so a model whose attention does something this function does not implement raises
instead of training a different model. Refused too: a 4-D ``attention_mask``, attention dropout, ``labels=``
(HF shifts them within the chunk, wrong at chunk edges), bidirectional attention (``is_causal=False``: an encoder
such as BERT), attention modules whose class does not dispatch through ``AttentionInterface`` (Falcon's, which
would compute attention over the chunk alone), and token mixing outside attention (the state-space, convolution,
recurrent and linear-attention layers of hybrid models: Jamba, Bamba, LFM2, Qwen3-Next, RecurrentGemma; found by
``config.layer_types`` and by convolution or recurrent modules), which would run on the chunk alone too. As a last
guard every attention module checks, each time it runs, that it called this function. The values' head size may
differ from the keys' (DeepSeek's multi-head latent attention).

A 2-D padding ``attention_mask`` (1 for a token, 0 for padding; this rank's part cut by ``split_sequence`` like the
tokens, or the whole sequence's) is taken by the model's forward: gathered once, each padding token becomes a document
of its own (documents.py: `padding_documents`), so no real token attends to padding, and transformers builds no mask.
As in transformers, a 2-D mask replaces what packed position ids would say. A padding token's own output differs from
transformers' (it sees only itself here; transformers' eager and SDPA attention disagree there too), so no label may
be predicted at a padding position: with HuggingFace's labels (shifted inside the loss), -100 on the padding and,
after left padding, on the first token. A model that numbers its positions from the mask (OPT: ``cumsum(mask) - 1``,
so a left-padded row starts at 0 at its first token) is refused on left-padded rows unless position_ids are given:
here every token gets its place in the whole sequence.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .._mixin import mix_in
from .documents import (NOT_FILED, check_padding_mask, chunk_local, file_documents, filed_documents,
                        packed_documents, padding_documents)
from .split import gather_sequence
from .state import ContextParallelState, get_state, set_state

__all__ = ["HF_ATTENTION", "apply_hf", "hf_attention", "is_hf", "packed_rows"]

#: the name under which the attention is registered in transformers' AttentionInterface
HF_ATTENTION = "shardwise_context_parallel"

#: keywords transformers' attention modules pass along that do not change the attention's result
_NEUTRAL = frozenset({"position_ids", "cache_position", "use_cache", "output_router_logits", "output_attentions",
                      "past_key_values", "past_key_value", "encoder_hidden_states", "layer_idx"})


class _Calls:
    """How many times an attention module called `hf_attention` (the guard in ContextParallelHFAttentionMixin)."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0


class _Packing:
    """Whether the model's forward now running was given packed position ids or a padding mask (`padded`): shared
    by the model and its attention modules, so an attention call without ``position_ids`` then raises instead of
    ignoring the packing, and one with position ids the forward did not file raises instead of losing the padding."""

    __slots__ = ("active", "padded")

    def __init__(self) -> None:
        self.active = self.padded = False


_PACKING_MESSAGE = ("pack documents into rows and mark them by position_ids that restart at each document (what "
                    "DataCollatorWithFlattening gives), cut by split_sequence like the tokens")


def hf_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                 **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: (B, H, L, D) in, (B, L, H, D) out, no attention weights."""
    state, who = get_state(module), type(module).__name__
    if state is None:
        raise ValueError(f"attention implementation {HF_ATTENTION!r} is used by {who}, which "
                         f"shardwise.context_parallel.apply did not prepare: apply it to the whole model; or this "
                         f"model was built from the config object of a model apply prepared (apply selects its "
                         f"attention in that object): build it from a config of its own (copy.deepcopy(config))")
    calls = module.__dict__.get("_shardwise_cp_calls")
    if calls is not None:
        calls.count += 1
    if attention_mask is not None:  # the model's forward turns a padding mask into documents and passes none
        raise ValueError(f"context parallel attention: {who} was given a {type(attention_mask).__name__} "
                         f"attention mask; the model's forward takes the 2-D padding mask (B, L) and keeps the "
                         f"padding apart itself; allowed here: None")
    if dropout:  # GPT-2 passes its attn_pdrop here in training mode: the blockwise attention has no dropout
        raise ValueError(f"context parallel attention: attention dropout {dropout} is not implemented by ring / "
                         f"Ulysses attention; allowed: 0.0 (e.g. GPT2Config(attn_pdrop=0.0), or eval())")
    window = _window(module, kwargs)
    if window is not None and query.shape[2] * state.comm.size <= window:
        window = None  # a window at least as long as the sequence masks nothing
    causal = kwargs.pop("is_causal", None)
    if (getattr(module, "is_causal", True) if causal is None else causal) is False:
        raise ValueError(_bidirectional(who))
    softcap, sinks = kwargs.pop("softcap", None), kwargs.pop("s_aux", None)
    other = sorted(k for k, v in kwargs.items() if k not in _NEUTRAL and v is not None and v is not False)
    if other:
        raise ValueError(f"context parallel attention: {who} passes {other} to its attention function, which ring "
                         f"/ Ulysses attention does not implement (it implements scaling, softcap, s_aux sinks and "
                         f"a sliding window); use cp=1 for this model")
    documents = _attention_documents(module, state, kwargs.get("position_ids"), who)
    out = state.attend(query, key, value, scale=scaling, softcap=softcap, sinks=sinks, window=window,
                       documents=documents)
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def packed_rows(module: nn.Module, padded: bool = False) -> Iterator[None]:
    """Run `module` (decoder layers of a model `apply_hf` prepared, called with packed rows' position ids, or with
    padded rows' documents filed under its positions (`padded`), by a caller other than the model's forward: pipeline
    stages) so that an attention call without ``position_ids``, or with position ids nothing filed while padded,
    raises instead of attending across the documents or to the padding, as under the prepared model's own forward."""
    flags = {id(flag): flag for flag in (m.__dict__.get("_shardwise_cp_packing") for m in module.modules())
             if flag is not None}
    for flag in flags.values():
        flag.active, flag.padded = True, padded
    try:
        yield
    finally:
        for flag in flags.values():
            flag.active = flag.padded = False


def _attention_documents(module: nn.Module, state: ContextParallelState, positions: torch.Tensor | None,
                         who: str) -> torch.Tensor | None:
    """The whole sequence's document ids for this attention call (documents.py), None for unpacked rows: filed by
    the model's forward under the position tensor's identity, else found from it (one all-gather)."""
    if positions is None:
        packing = module.__dict__.get("_shardwise_cp_packing")
        if packing is not None and packing.active:
            raise ValueError(f"context parallel attention: {who} does not pass position_ids to its attention "
                             f"function, so the packed documents they mark cannot be kept apart; allowed for this "
                             f"model: rows of one sequence each (no position_ids)")
        return None
    documents = filed_documents(positions)
    if documents is NOT_FILED:  # a position tensor the model made itself: every rank finds it the same way
        packing = module.__dict__.get("_shardwise_cp_packing")
        if packing is not None and packing.padded:
            raise ValueError(f"context parallel attention: {who} passes position ids its model's forward did not "
                             f"give it, so the padding of the attention_mask cannot be found for them; allowed for "
                             f"this model: no attention_mask (pack the rows, {_PACKING_MESSAGE})")
        documents = _documents_of(positions, state)
        file_documents(positions, documents)
    return documents


def _documents_of(positions: torch.Tensor, state: ContextParallelState) -> torch.Tensor | None:
    """The documents `positions` (this rank's (b, L) position ids) mark over the whole sequence, None for one
    sequence per row; ValueError for chunk-local positions. Every rank of the group calls it (an all-gather)."""
    whole = gather_sequence(positions, state.comm, zigzag=state.zigzag, dim=1)  # (b, T), in sequence order
    if chunk_local(whole, state.split):
        raise ValueError(f"context parallel HF model: position_ids are 0..{positions.shape[-1] - 1} on every rank, "
                         f"positions within each rank's chunks; they must be the whole sequence's position ids cut "
                         f"by split_sequence (context_parallel.sequence_positions for rows of one sequence), or "
                         f"none and the model computes them")
    return packed_documents(whole)


def _window(module: nn.Module, kwargs: dict[str, Any]) -> int | None:
    """The sliding window of this attention call: the ``sliding_window`` keyword the module passes (Mistral, Gemma,
    GPT-OSS; None on their full layers), else the module's own ``sliding_window`` (Qwen2-MoE sets it and windows
    through the mask alone), else, for a model that applies ``config.sliding_window`` to every layer through its
    mask (Phi-MoE: its modeling file builds sliding-window masks), that; None without one (a ``sliding_window`` in
    the config of a model that never reads it, Llama's, windows nothing). Consumes the keyword."""
    if "sliding_window" in kwargs:
        return kwargs.pop("sliding_window")
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    config = getattr(module, "config", None)
    windows = any(hasattr(sys.modules.get(cls.__module__), "create_sliding_window_causal_mask")
                  for cls in type(module).__mro__)
    if windows and getattr(config, "layer_types", None) is None:
        return getattr(config, "sliding_window", None)
    return None


def _bidirectional(who: str) -> str:
    return (f"context parallel attention: {who} attends both ways (is_causal=False, an encoder such as BERT); ring / "
            f"Ulysses attention here is causal; allowed: decoders with causal self-attention")


class ContextParallelHFMixin:
    """HF model forward with ``position_ids`` = the global positions of this rank's tokens (rotary offsets)."""

    def forward(self, input_ids: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> Any:
        if args:
            raise ValueError("context parallel HF model: pass the arguments after input_ids by keyword")
        if kwargs.get("labels") is not None:
            raise ValueError("context parallel HF model: labels= shifts targets within this rank's chunk, wrong at "
                             "chunk edges; compute the loss from .logits against split_sequence((x, y))'s targets")
        mask = kwargs.pop("attention_mask", None)  # padding: documents of its own (below), never HF's 4-D mask
        packing, documents = self.__dict__["_shardwise_cp_packing"], None
        ref = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
        if ref is None and mask is not None:
            raise ValueError("context parallel HF model: attention_mask needs input_ids or inputs_embeds")
        if ref is not None:
            state = get_state(self)
            state.split.chunk_len(ref.shape[1], "context parallel HF model")
            given = kwargs.get("position_ids")
            if given is None:
                positions = state.positions(ref.shape[1], ref.device).unsqueeze(0).expand(ref.shape[0], -1)
            else:
                _check_positions(given, ref)
                positions, documents = given, _documents_of(given, state)
            if mask is not None:  # as transformers decides: a 2-D mask, not packed positions, says who sees whom
                B, L = ref.shape[:2]
                mask = check_padding_mask(mask, B, (L, L * state.comm.size), "this rank's tokens cut by "
                                          "split_sequence, or the whole sequence's", "context parallel HF model")
                documents = padding_documents(mask, state.comm, state.split, L)
                _refuse_shifted_positions(self, documents, given)
            file_documents(positions, documents)
            kwargs["position_ids"] = positions
        kwargs.setdefault("use_cache", False)  # no generation cache: a chunk is not a prefix of the sequence
        packing.active, packing.padded = documents is not None, mask is not None
        try:
            return super().forward(input_ids, **kwargs)
        finally:
            packing.active = packing.padded = False

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError("context parallel HF model: generate() extends sequences one token at a time, which chunks "
                         "split over ranks cannot; generate with a plain model holding sw.full_state_dict(model)")


def _refuse_shifted_positions(model: nn.Module, documents: torch.Tensor | None, given: object) -> None:
    """A model that computes its position ids from the attention mask (OPT's decoder: ``cumsum(mask) - 1``,
    `_mask_positions`) numbers each left-padded row from its first token; here every token gets its place in the
    whole sequence (rotary and position embeddings), which differs on such rows: refused unless the caller gives
    the positions."""
    where = model.__dict__.get("_shardwise_cp_mask_positions")
    if where is None or documents is None or given is not None:
        return
    padding = documents < 0  # padding's documents (documents.py)
    if bool(((padding.cumsum(-1) > 0) & ~padding).any()):  # a token after padding: left padding
        raise ValueError(f"context parallel HF model: {where} computes the position ids from the attention mask, "
                         f"which numbers a left-padded row from its first token; context parallel gives every token "
                         f"its place in the whole sequence instead; allowed: rows padded on the right, or "
                         f"position_ids given (cumsum(attention_mask, -1) - 1, cut by split_sequence like the tokens)")


def _mask_positions(model: nn.Module) -> str | None:
    """The first module of `model` whose forward fills in missing position ids from the attention mask (its code
    names ``position_ids``, ``attention_mask`` and ``cumsum``: OPT's decoder), named with its class; None when none
    does. Position-embedding modules are not counted: BioGPT's falls back to the mask too, but its model always
    gives it positions."""
    from ..experts.hf_kinds import model_forward, unwrapped

    for name, module in model.named_modules():
        code = getattr(unwrapped(model_forward(module)), "__code__", None)
        if code is not None and not type(module).__name__.endswith("Embedding") and "cumsum" in code.co_names \
                and {"attention_mask", "position_ids"} <= set(code.co_varnames):
            return f"{name or 'the model'} ({type(module).__name__})"
    return None


def _check_positions(positions: object, ref: torch.Tensor) -> None:
    B, L = ref.shape[:2]
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2 or positions.is_floating_point() \
            or positions.shape[0] not in (1, B) or positions.shape[1] != L:
        got = (f"{positions.dtype} {tuple(positions.shape)}" if isinstance(positions, torch.Tensor)
               else type(positions).__name__)
        raise ValueError(f"context parallel HF model: position_ids must be an integer tensor ({B} or 1, {L}), this "
                         f"rank's tokens' positions in the whole sequence, got {got}")


class ContextParallelHFAttentionMixin:
    """An attention module that checks, each time it runs, that it called :func:`hf_attention`: one that computes
    attention some other way would attend over this rank's chunk only and train a different model."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        calls = self.__dict__["_shardwise_cp_calls"]
        before = calls.count
        out = super().forward(*args, **kwargs)
        if calls.count == before:
            raise ValueError(f"context parallel: {type(self).__name__} ran without calling the attention function "
                             f"the config selects ({HF_ATTENTION!r}), so it attended over this rank's chunk only; "
                             f"allowed: attention that dispatches through transformers' AttentionInterface")
        return out


def _uses_attention_interface(module: nn.Module) -> bool:
    """Whether the module's class (or a base) comes from a file that looks attention functions up by name."""
    return any(hasattr(sys.modules.get(cls.__module__), "ALL_ATTENTION_FUNCTIONS") for cls in type(module).__mro__)


def _attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The innermost modules whose class name ends in 'Attention' (BertSelfAttention, not BertAttention around it)."""
    named = [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith("Attention")]
    return [(n, m) for n, m in named
            if not any(o is not m and type(o).__name__.endswith("Attention") for o in m.modules())]


#: Layer types (``config.layer_types``) whose token mixing is attention that `hf_attention` computes exactly.
_ATTENTION_LAYERS = ("full_attention", "sliding_attention")


def _other_sequence_mixing(model: nn.Module) -> str | None:
    """What in `model` mixes tokens along the sequence other than attention (a state-space, convolution, recurrent
    or linear-attention layer: Jamba, Bamba, LFM2, Qwen3-Next, RecurrentGemma), in words; None when nothing does.
    Such a layer would run on this rank's chunks alone: context parallel splits the sequence under it."""
    types = getattr(model.config, "layer_types", None) or ()
    other = sorted({t for t in types if t not in _ATTENTION_LAYERS})
    if other:
        first = next(i for i, t in enumerate(types) if t in other)
        return f"config.layer_types has {other} (layer {first} is {types[first]!r})"
    for name, module in model.named_modules():
        if isinstance(module, (nn.modules.conv._ConvNd, nn.RNNBase)):
            return f"{name} is a {type(module).__name__} (in {_owner_class(model, name)})"
    return None


def _owner_class(model: nn.Module, name: str) -> str:
    parent = name.rpartition(".")[0]
    return type(model.get_submodule(parent)).__name__ if parent else type(model).__name__


def apply_hf(model: nn.Module, state: ContextParallelState) -> None:
    """Select :func:`hf_attention` in `model`'s config and mark its attention modules and forward (module
    docstring). ValueError for what it cannot make exact."""
    from transformers import AttentionInterface

    config = _own_config(model)
    for field in ("attention_dropout", "attn_pdrop"):  # Llama family; GPT-2
        if getattr(config, field, 0.0):
            raise ValueError(f"context_parallel.apply: {field}={getattr(config, field)} is not implemented by ring / "
                             f"Ulysses attention; allowed: 0.0")
    mixing = _other_sequence_mixing(model)
    if mixing is not None:
        raise ValueError(f"context_parallel.apply: {type(model).__name__} mixes tokens along the sequence outside "
                         f"attention ({mixing}); context parallel splits the sequence, so that layer would see this "
                         f"rank's chunks only; allowed: decoders whose only token mixing is attention")
    attention = _attention_modules(model)
    if not attention:
        raise ValueError(f"context_parallel.apply: found no attention module (class name ending in 'Attention') in "
                         f"{type(model).__name__}")
    for name, module in attention:
        if not _uses_attention_interface(module):
            raise ValueError(f"context_parallel.apply: {name} ({type(module).__name__}) computes attention itself, "
                             f"not through transformers' AttentionInterface, so ring / Ulysses attention cannot "
                             f"replace it; allowed: decoders whose attention uses AttentionInterface (Llama family)")
        if getattr(module, "is_causal", True) is False:
            raise ValueError(_bidirectional(f"{name} ({type(module).__name__})"))
    AttentionInterface.register(HF_ATTENTION, hf_attention)
    config._attn_implementation = HF_ATTENTION
    packing = _Packing()
    for _, module in attention:
        set_state(module, state)
        object.__setattr__(module, "_shardwise_cp_calls", _Calls())
        object.__setattr__(module, "_shardwise_cp_packing", packing)
        mix_in(module, ContextParallelHFAttentionMixin, "ContextParallel")
    object.__setattr__(model, "_shardwise_cp_packing", packing)
    object.__setattr__(model, "_shardwise_cp_mask_positions", _mask_positions(model))
    mix_in(model, ContextParallelHFMixin, "ContextParallel")


def _own_config(model: nn.Module) -> Any:
    """Give `model` a config object of its own: a deep copy (its sub-configs too), put in place of the old one
    wherever a submodule held it. Selecting the ring / Ulysses attention in it then leaves alone another model built
    from the same config object (an RLHF reference model, an evaluation copy), which would otherwise run this
    attention unprepared. Returns the copy."""
    from transformers import PretrainedConfig

    memo: dict[int, Any] = {}
    copied = copy.deepcopy(model.config, memo)
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, PretrainedConfig) and id(value) in memo:
                object.__setattr__(module, name, memo[id(value)])
    return copied


def is_hf(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)
