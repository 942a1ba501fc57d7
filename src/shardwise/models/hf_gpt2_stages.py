"""GPT-2-shaped HuggingFace decoders as pipeline layers: GPT-2, GPT-BigCode (StarCoder, SantaCoder), GPT-Neo, GPT-J
and CodeGen.

Their causal LMs share one shape, which differs from Llama's (hf_stages.py) in names and in where positions enter:
``transformer.wte`` embeds the tokens, ``transformer.wpe`` adds learned position embeddings (GPT-2, GPT-BigCode,
GPT-Neo; GPT-J and CodeGen have none: their attention rotates queries and keys by the position ids each block is
given), ``transformer.drop`` drops out the sum, the blocks of ``transformer.h`` run with the causal mask (and the
position ids), ``transformer.ln_f`` normalises and ``lm_head`` gives the logits, with nothing else between (checked
against each family's ``forward`` in transformers 5.x; tests/test_hf_gpt2_stages.py compares the stages' logits and
training with the model's own). GPT-Neo's local layers apply their window inside the attention (a mask buffer of
their own), on top of the mask the stage gives.

The stages are the GPT-2 ones, with or without ``wpe``; everything else (the additive causal mask, packed rows'
positions and documents, padded rows, context parallel's global positions) is hf_stage_inputs.py's, as for Llama.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..comm.base import Communicator
from .hf_stage_inputs import (CausalMasks, StagePositions, check_attention, check_ids, given_positions, layer_inputs,
                              packed_layer, padding_of, passed_on, submodule)
from .hf_stages import HFHeadStage

__all__ = ["GPT2_SHAPED", "GPT2BlockStage", "GPT2EmbeddingStage", "gpt2_pipeline_layers"]

#: ``config.model_type`` of the GPT-2-shaped families -> whether they add learned position embeddings (``wpe``).
GPT2_SHAPED = {"gpt2": True, "gpt_bigcode": True, "gpt_neo": True, "gptj": False, "codegen": False}


class GPT2EmbeddingStage(nn.Module):
    """First stage of GPT-2: ``drop(wte(input_ids) + wpe(positions))``, (B, T) int -> (B, T, d); without `wpe`
    (GPT-J, CodeGen) ``drop(wte(input_ids))``."""

    def __init__(self, wte: nn.Module, wpe: nn.Embedding | None, drop: nn.Module,
                 positions: StagePositions | None = None) -> None:
        super().__init__()
        self.wte = wte
        self.wpe = wpe
        self.drop = drop
        self._positions = positions if positions is not None else StagePositions()

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> Any:
        who = "GPT2EmbeddingStage"
        limit = None if self.wpe is None else self.wpe.num_embeddings // self._positions.global_length(1)
        check_ids(input_ids, who, limit)
        given = given_positions(position_ids, input_ids, who)
        hidden = self.wte(input_ids)
        if self.wpe is not None:
            # Same operand order as GPT2Model.forward (token embeddings first), so the sum is bitwise the same.
            hidden = hidden + self.wpe(self._positions(input_ids, given))
        return passed_on(self.drop(hidden), given, padding_of(attention_mask, input_ids, self._positions, who))


class GPT2BlockStage(nn.Module):
    """One block of ``transformer.h`` as a stage: hidden (B, T, d) -> hidden (B, T, d), with the additive causal
    mask and the position ids (GPT-J's and CodeGen's rotary embeddings; the other families ignore them)."""

    def __init__(self, block: nn.Module, config: object, masks: CausalMasks) -> None:
        super().__init__()
        self.block = block
        self.config = config
        self._masks = masks

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> Any:
        who = "GPT2BlockStage"
        given, positions, documents = layer_inputs(self.config, self._masks, hidden, position_ids, documents, who)
        with packed_layer(self.block, self._masks.positions, given, documents):
            out = self.block(hidden, attention_mask=self._masks(hidden, None, who, given, documents),
                             position_ids=positions)
        return passed_on(out[0] if isinstance(out, tuple) else out, given, documents)


def gpt2_pipeline_layers(model: nn.Module, *, cp: Communicator | None = None, zigzag: bool = True
                         ) -> list[nn.Module]:
    """``[GPT2EmbeddingStage, GPT2BlockStage per block, HFHeadStage]`` for a GPT-2-shaped causal LM
    (`GPT2_SHAPED`: ``GPT2LMHeadModel``, ``GPTBigCodeForCausalLM``, ``GPTNeoForCausalLM``, ``GPTJForCausalLM``,
    ``CodeGenForCausalLM``).

    The stages hold the model's ``transformer.wte``, ``.wpe`` (where the family has one), ``.drop``, each block of
    ``.h``, ``.ln_f`` and ``lm_head`` (no copies); a tied ``lm_head.weight`` is ``wte.weight``, so the first and last
    stage share that Parameter. Applying them in order to input_ids (B, T) gives ``model(input_ids).logits``. Raises
    ValueError naming what is missing for another structure, and for an attention implementation other than eager or
    sdpa. cp, zigzag: as for `llama_pipeline_layers` (context parallel).
    """
    who = "gpt2_pipeline_layers"
    kind = getattr(getattr(model, "config", None), "model_type", "gpt2")
    with_positions = GPT2_SHAPED.get(kind, True)
    expected = (f"a GPT-2-shaped causal LM (model.transformer.wte, {'.wpe, ' if with_positions else ''}.drop, .h, "
                f".ln_f; model.lm_head)")
    paths = [("wte", "transformer.wte"), ("drop", "transformer.drop"), ("h", "transformer.h"),
             ("ln_f", "transformer.ln_f"), ("lm_head", "lm_head")]
    parts = {name: submodule(model, path, who, expected)
             for name, path in paths + ([("wpe", "transformer.wpe")] if with_positions else [])}
    config = model.config
    masks = CausalMasks(StagePositions(cp, zigzag))
    check_attention(config, who, masks.positions)
    return [
        GPT2EmbeddingStage(parts["wte"], parts.get("wpe"), parts["drop"], masks.positions),
        *(GPT2BlockStage(block, config, masks) for block in parts["h"]),
        HFHeadStage(parts["ln_f"], parts["lm_head"]),
    ]
