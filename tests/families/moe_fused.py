"""moe_fused: HuggingFace ``MixtralForCausalLM``, tiny: a mixture-of-experts decoder whose experts are FUSED into
3-D parameters (``experts.gate_up_proj`` (E, 2 x ffn, hidden), ``experts.down_proj`` (E, hidden, ffn)).

Model: vocab 64, hidden 32, 2 layers, 4 query heads / 2 key-value heads, 4 experts of width 32, top-2 routing
(softmax over the router logits, the top 2 renormalised), no router jitter; untied embeddings; fp32; eager
attention and ``experts_implementation="eager"`` (a Python loop over the experts hit, indexing the fused tensors;
5.23's default would be ``grouped_mm`` where torch supports it). 35,232 parameters in 21 tensors, 21 state-dict
keys.

Router losses OFF: ``output_router_logits=False`` (no load-balancing loss is computed, and its coefficient
``router_aux_loss_coef`` is 0 as well): that loss is a product of batch means, not a mean over examples, so no
data-parallel library reproduces it on slices.

The router is ``mlp.gate.weight`` (E, hidden), a bare Parameter of ``MixtralTopKRouter``, not an nn.Linear.
Ties: none. Buffers: ``model.rotary_emb.inv_freq`` / ``original_inv_freq`` (fp32, non-persistent).
Fused experts: an expert that gets no token still gets a gradient (zeros in its slice of the 3-D tensor) as long as
the layer's fused tensor is used by any token, so no parameter here ever has grad None.

Batch: 8 rows of 12 tokens (ids 0..63), ``labels = input_ids``; HuggingFace shifts and averages over 8 x 11 tokens
(per-token routing with no capacity limit, so routing is row-local and equal slices average to the whole loss).
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, EXPERTS, TOP_K, SEQ, BATCH = 64, 32, 2, 4, 2, 32, 4, 2, 12, 8

NOTES = ("experts fused into 3-D Parameters (E, out, in) indexed per expert: sharding must split or keep a 3-D "
         "tensor whole; unused experts get zero (not None) gradients; data-dependent routing; router aux loss off")
MAX_NORM = 0.5
TP_PLAN = None


def build() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                           num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=32,
                           num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, router_jitter_noise=0.0,
                           output_router_logits=False, router_aux_loss_coef=0.0, attention_dropout=0.0,
                           sliding_window=None, tie_word_embeddings=False, pad_token_id=None, bos_token_id=0,
                           eos_token_id=1, attn_implementation="eager", experts_implementation="eager")
    return MixtralForCausalLM(config)


def batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4000 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch, use_cache=False, output_router_logits=False).loss
