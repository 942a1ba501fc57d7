"""decoder_tied: HuggingFace ``LlamaForCausalLM``, tiny, with ``tie_word_embeddings=True`` and grouped-query
attention.

Model: vocab 64, hidden 32, 2 layers, 8 query heads / 4 key-value heads (head_dim 4), MLP 64 (SwiGLU), RMSNorm,
RoPE, 32 positions; attention dropout 0; no biases; fp32; eager attention. 20,640 parameters in 20 tensors (21
names with the tie, 21 state-dict keys).

Ties: ``lm_head.weight`` IS ``model.embed_tokens.weight`` (listed once by ``named_parameters()``, as
``model.embed_tokens.weight``; both names in ``state_dict()``).

Buffers: ``model.rotary_emb.inv_freq`` and ``model.rotary_emb.original_inv_freq`` (fp32, non-persistent: not in the
state dict); one rotary module at the model level serves every layer (its output is shared, the buffer is not
registered twice).

Batch: 8 rows of 12 tokens (ids 0..63, no padding), ``labels = input_ids``; HuggingFace shifts inside and averages
the cross entropy over 8 x 11 tokens, 11 per row: equal slices average to the whole batch's loss.

Tensor parallel (TP_PLAN): q/k/v/gate/up colwise, o/down rowwise, ``embed_tokens`` vocabulary-parallel and the tied
``lm_head`` column-parallel with gathered logits (the same row split as the embedding, so one shared shard; the
loss is HuggingFace's over full logits). Llama's attention reshapes with ``(-1, head_dim)`` and repeats k/v by
heads // kv_heads, a ratio tp leaves unchanged, so no head count needs adjusting. Heads 8 / kv 4 / MLP 64 / vocab 64
are divisible by tp = 2 and 4.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.tensor_parallel import Colwise

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, SEQ, BATCH = 64, 32, 2, 8, 4, 64, 12, 8

NOTES = ("lm_head.weight is embed_tokens.weight (a tie across the first and last layer: one gradient summed from "
         "both uses), grouped-query attention (k/v projections narrower than q), RoPE buffers")
MAX_NORM = 0.5
TP_PLAN = {
    "embed_tokens": "vocab",
    "q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise",
    "gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise",
    "lm_head": Colwise(gather_output=True),
}


def build() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=32,
                         attention_dropout=0.0, tie_word_embeddings=True, pad_token_id=None, bos_token_id=0,
                         eos_token_id=1, attn_implementation="eager")
    return LlamaForCausalLM(config)


def batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3000 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch, use_cache=False).loss
