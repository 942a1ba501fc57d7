"""encoder_decoder: HuggingFace ``BartForConditionalGeneration``, tiny: one embedding shared by the encoder, the
decoder and the LM head.

Model: vocab 64, d_model 32, 1 encoder + 1 decoder layer, 4 heads, FFN 64, 16 learned positions (offset 2, so 18
rows); dropout / attention / activation dropout and LayerDrop 0; fp32; eager attention. 24,704 parameters in 49
tensors (52 names with the ties; 53 state-dict keys with the buffer).

Ties (transformers 5.23): ``model.shared.weight`` IS ``model.encoder.embed_tokens.weight`` IS
``model.decoder.embed_tokens.weight`` IS ``lm_head.weight`` (one Parameter, four names; ``named_parameters()``
lists it once as ``model.shared.weight``). The encoder and decoder position embeddings are separate.

Buffers: ``final_logits_bias`` (1, vocab) fp32 zeros, PERSISTENT (in the state dict) and added to the logits every
forward, never trained. Not shared.

Batch: encoder input 8 x 10 tokens, labels 8 x 8 tokens (ids 4..63: no pad=1, bos=0, eos=2 inside, no -100);
the decoder input is HuggingFace's shift of the labels right (start token 2). Loss: CrossEntropyLoss(mean) over all
64 label tokens, 8 per row: equal slices average to the whole batch's loss.

Zero-gradient parameters: every attention key bias (``k_proj.bias`` (3 of them)) has an exactly zero true
gradient (softmax ignores the shift q . b_k), so its computed gradient is rounding noise: see the package
docstring (families/__init__.py) for AdamW's eps.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB, D_MODEL, HEADS, FFN, SRC, TGT, BATCH, FIRST_ID = 64, 32, 4, 64, 10, 8, 8, 4

NOTES = ("one embedding Parameter used in three places (encoder input, decoder input, lm_head) + a persistent "
         "untrained buffer (final_logits_bias) added to the logits; encoder and decoder of different lengths")
MAX_NORM = 0.5
TP_PLAN = None


def build() -> nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(vocab_size=VOCAB, d_model=D_MODEL, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN,
                        decoder_ffn_dim=FFN, max_position_embeddings=16, dropout=0.0, attention_dropout=0.0,
                        activation_dropout=0.0, classifier_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0,
                        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                        forced_eos_token_id=None, tie_word_embeddings=True, attn_implementation="eager")
    return BartForConditionalGeneration(config)


def batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    return {"input_ids": torch.randint(FIRST_ID, VOCAB, (BATCH, SRC), generator=g),
            "attention_mask": torch.ones(BATCH, SRC, dtype=torch.long),
            "labels": torch.randint(FIRST_ID, VOCAB, (BATCH, TGT), generator=g)}


def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss
