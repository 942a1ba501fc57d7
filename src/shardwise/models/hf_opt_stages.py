"""OPT (Zhang et al. 2022, "OPT: Open Pre-trained Transformer Language Models") as pipeline layers.

``OPTDecoder.forward`` (transformers 5.x) embeds the tokens (``embed_tokens``, then ``project_in`` where the word
embeddings are narrower than the model, as in OPT-350m), adds learned position embeddings (``embed_positions``, which
offsets each position by 2), runs the decoder layers with the causal mask and the position ids, then applies
``final_layer_norm`` (None where ``do_layer_norm_before`` is False) and ``project_out``; ``lm_head`` (tied to
``embed_tokens``) gives the logits.

Its positions are not ``arange(T)``: without position ids the decoder counts each row's tokens from its first one
that is not padding, ``cumsum(attention_mask) * attention_mask - 1`` (a padding token at -1), so a left-padded row's
first token sits at position 0. `OPTEmbeddingStage` does the same from the whole sequence's padding, the documents
hf_stage_inputs.padding_of makes of the mask it is given (under context parallel gathered over the group once),
read at each of this rank's tokens' places. Packed rows' position ids are used as given, as the decoder uses them, and
their documents kept apart by the stages' mask, as transformers does under flash attention (OPT's own eager and SDPA
masks ignore the position ids: hf_packing.py).

The layers are GPT-2's stages (hf_gpt2_stages.GPT2BlockStage: the additive mask and the position ids); LayerDrop
(``config.layerdrop > 0``, layers skipped at random in training) is refused by name.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..comm.base import Communicator
from .hf_gpt2_stages import GPT2BlockStage
from .hf_stage_inputs import (CausalMasks, StagePositions, check_attention, check_ids, given_positions, padding_of,
                              passed_on, submodule)
from .hf_stages import HFHeadStage

__all__ = ["OPTEmbeddingStage", "opt_pipeline_layers"]


class OPTEmbeddingStage(nn.Module):
    """First stage of OPT: ``project_in(embed_tokens(input_ids)) + embed_positions(positions)``, (B, T) int ->
    (B, T, d), the positions counted from each row's first token (module docstring)."""

    def __init__(self, embed_tokens: nn.Module, embed_positions: nn.Embedding, project_in: nn.Module | None,
                 positions: StagePositions | None = None) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.embed_positions = embed_positions
        self.project_in = project_in
        self._positions = positions if positions is not None else StagePositions()

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> Any:
        who = "OPTEmbeddingStage"
        offset = getattr(self.embed_positions, "offset", 0)
        check_ids(input_ids, who, (self.embed_positions.num_embeddings - offset) // self._positions.global_length(1))
        given = given_positions(position_ids, input_ids, who)
        documents = padding_of(attention_mask, input_ids, self._positions, who)
        hidden = self.embed_tokens(input_ids)
        if self.project_in is not None:
            hidden = self.project_in(hidden)
        # Same operand order as OPTDecoder.forward (token embeddings first), so the sum is bitwise the same.
        hidden = hidden + self.embed_positions(None, 0, position_ids=self._counted(input_ids, given, documents))
        return passed_on(hidden, given, documents)

    def _counted(self, input_ids: torch.Tensor, given: torch.Tensor | None, documents: torch.Tensor | None
                 ) -> torch.Tensor:
        """OPT's position of each of this rank's tokens: the given ones, else its place among its row's tokens,
        counted on the whole sequence's padding (`documents`, padding_of's: under context parallel already gathered)."""
        places = self._positions(input_ids, given)
        if given is not None or documents is None:
            return places
        from ..context_parallel.documents import token_mask

        whole = token_mask(documents)  # (B, T): 1 a token, 0 padding
        counted = torch.cumsum(whole, dim=1) * whole - 1
        return counted.gather(1, places.expand(input_ids.shape[0], -1))


def opt_pipeline_layers(model: nn.Module, *, cp: Communicator | None = None, zigzag: bool = True
                        ) -> list[nn.Module]:
    """``[OPTEmbeddingStage, GPT2BlockStage per decoder layer, HFHeadStage]`` for ``transformers.OPTForCausalLM``.

    The stages hold the model's ``model.decoder.embed_tokens``, ``.embed_positions``, ``.project_in``, each of
    ``.layers``, ``.final_layer_norm`` and ``.project_out`` (those the model has) and ``lm_head`` (no copies).
    Applying them in order to input_ids (B, T) gives ``model(input_ids).logits``. ValueError naming what is missing
    for another structure, for LayerDrop, and for an attention implementation other than eager or sdpa. cp, zigzag:
    as for `llama_pipeline_layers` (context parallel)."""
    who = "opt_pipeline_layers"
    expected = "an OPT causal LM (model.model.decoder.embed_tokens, .embed_positions, .layers; model.lm_head)"
    parts = {name: submodule(model, f"model.decoder.{name}", who, expected)
             for name in ("embed_tokens", "embed_positions", "layers")}
    decoder = model.get_submodule("model.decoder")
    config = model.config
    if getattr(config, "layerdrop", 0.0) > 0.0:
        raise ValueError(f"{who}: {type(model).__name__} has layerdrop={config.layerdrop} (decoder layers skipped at "
                         f"random in training), which pipeline stages do not do; set config.layerdrop = 0.0")
    masks = CausalMasks(StagePositions(cp, zigzag))
    check_attention(config, who, masks.positions)
    ends = [m for m in (decoder.final_layer_norm, decoder.project_out) if m is not None]
    return [
        OPTEmbeddingStage(parts["embed_tokens"], parts["embed_positions"], decoder.project_in, masks.positions),
        *(GPT2BlockStage(layer, config, masks) for layer in parts["layers"]),
        HFHeadStage(nn.Sequential(*ends) if ends else nn.Identity(), submodule(model, "lm_head", who, expected)),
    ]
