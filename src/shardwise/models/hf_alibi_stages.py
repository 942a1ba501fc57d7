"""BLOOM and MPT, the ALiBi decoders (Press et al. 2022, "Train Short, Test Long: Attention with Linear Biases"), as
pipeline layers.

Neither rotates nor embeds positions: each attention head adds ``slope_h x key position`` to its scores. Their
forwards (transformers 5.x) build the biases once for every layer, as the causal mask: BLOOM from the padding mask
(``build_alibi_tensor``: each key at its place among its row's tokens, ``cumsum(attention_mask) - 1``; without a mask
``arange``), MPT once for ``config.max_seq_len`` positions (``build_mpt_alibi_tensor``, sliced by its attention to the
keys it has). A decoder stage here builds them as its model's forward does, with the model's own functions: BLOOM's
from the padding the first stage passed on (padded rows' documents, hf_stage_inputs.padding_of) or from whole rows.
BLOOM's embedding stage applies ``word_embeddings_layernorm`` after the lookup; MPT's final norm is ``norm_f``, and
its attention takes the causal mask as booleans (True: hidden), as its forward converts it.

Packed rows' documents are kept apart by the stages' mask, as transformers does under flash attention; BLOOM's and
MPT's own eager masks ignore the position ids (hf_packing.py), and the biases count positions along the whole row, as
their forwards do. Context parallel refuses both (their attention does not go through AttentionInterface).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..comm.base import Communicator
from .hf_stage_inputs import (CausalMasks, StagePositions, check_attention, check_ids, given_positions, layer_inputs,
                              padding_of, passed_on, submodule)
from .hf_stages import HFHeadStage

__all__ = ["ALIBI_PATHS", "AlibiBlockStage", "AlibiEmbeddingStage", "alibi_pipeline_layers"]

#: ``config.model_type`` -> (base model, token embedding, its norm or None, blocks, final norm)
ALIBI_PATHS = {"bloom": ("transformer", "word_embeddings", "word_embeddings_layernorm", "h", "ln_f"),
               "mpt": ("transformer", "wte", None, "blocks", "norm_f")}


class AlibiEmbeddingStage(nn.Module):
    """First stage: ``norm(embed(input_ids))`` (BLOOM's ``word_embeddings_layernorm``; MPT has no norm there)."""

    def __init__(self, embed: nn.Module, norm: nn.Module | None, positions: StagePositions | None = None) -> None:
        super().__init__()
        self.embed = embed
        self.norm = norm
        self._positions = positions if positions is not None else StagePositions()

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> Any:
        who = "AlibiEmbeddingStage"
        check_ids(input_ids, who)
        hidden = self.embed(input_ids)
        if self.norm is not None:
            hidden = self.norm(hidden)
        return passed_on(hidden, given_positions(position_ids, input_ids, who),
                         padding_of(attention_mask, input_ids, self._positions, who))


class AlibiBlockStage(nn.Module):
    """One BLOOM or MPT block as a stage: hidden (B, T, d) -> hidden (B, T, d), given the additive causal mask (MPT:
    as booleans) and the linear biases its model's forward would give it (module docstring)."""

    def __init__(self, block: nn.Module, config: object, masks: CausalMasks, kind: str, base: nn.Module) -> None:
        super().__init__()
        self.block = block
        self.config = config
        self.kind = kind
        self._masks = masks
        # The model's own bias builder (a bound method: the base model is not a submodule of the stage).
        self._biases = base.build_alibi_tensor if kind == "bloom" else base.build_mpt_alibi_tensor
        self._heads = base.num_heads

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> Any:
        who = "AlibiBlockStage"
        given, _, documents = layer_inputs(self.config, self._masks, hidden, position_ids, documents, who)
        mask = self._masks(hidden, None, who, given, documents)
        if self.kind == "bloom":
            from ..context_parallel.documents import token_mask

            B, T = hidden.shape[:2]
            tokens = token_mask(documents) if documents is not None else hidden.new_ones(B, T, dtype=torch.long)
            out = self.block(hidden, alibi=self._biases(tokens, self._heads, dtype=hidden.dtype),
                             attention_mask=mask)
        else:
            bias = self._biases(self._heads, self.config.max_seq_len, device=hidden.device)
            out = self.block(hidden, position_bias=bias, attention_mask=mask.to(torch.bool))
        return passed_on(out[0] if isinstance(out, tuple) else out, given, documents)


def alibi_pipeline_layers(model: nn.Module, *, cp: Communicator | None = None, zigzag: bool = True
                          ) -> list[nn.Module]:
    """``[AlibiEmbeddingStage, AlibiBlockStage per block, HFHeadStage]`` for ``BloomForCausalLM`` or
    ``MptForCausalLM`` (`ALIBI_PATHS`): the model's own modules, no copies. Applying them in order to input_ids
    (B, T) gives ``model(input_ids).logits``. ValueError naming what is missing for another structure, and for an
    attention implementation other than eager or sdpa. cp, zigzag: as for `llama_pipeline_layers`."""
    who = "alibi_pipeline_layers"
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind not in ALIBI_PATHS:
        raise ValueError(f"{who}: {type(model).__name__} is not one of {sorted(ALIBI_PATHS)}")
    prefix, embed, norm, blocks, final = ALIBI_PATHS[kind]
    expected = f"a {kind} causal LM (model.{prefix}.{embed}, .{blocks}, .{final}; model.lm_head)"
    base = submodule(model, prefix, who, expected)
    masks = CausalMasks(StagePositions(cp, zigzag))
    check_attention(model.config, who, masks.positions)
    return [
        AlibiEmbeddingStage(submodule(base, embed, who, expected),
                            submodule(base, norm, who, expected) if norm else None, masks.positions),
        *(AlibiBlockStage(block, model.config, masks, kind, base) for block in submodule(base, blocks, who, expected)),
        HFHeadStage(submodule(base, final, who, expected), submodule(model, "lm_head", who, expected)),
    ]
