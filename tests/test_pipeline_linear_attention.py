"""Pipeline stages for the hybrids of linear-attention and attention layers: Qwen3-Next and Qwen3.5 (dense and MoE),
whose gated DeltaNet layers (``layer_types`` "linear_attention") take transformers' 2-D padding mask, or None, in
place of the causal mask (models/hf_stages.py, ``LlamaDecoderStage(recurrent=True)``). Each through `sw.check` against
one process with left-padded rows (where the padding's zeroed inputs matter: they come before the tokens in the
recurrence): Qwen3-Next with its router loss on pp2 x dp2 ZeRO-3, Qwen3.5 on pp2 x tp2 (its own plan). Packed rows are
refused at a linear-attention layer (its recurrence would run across the documents)."""

from __future__ import annotations

import pytest
import torch
from test_labels_at_padding import left_padded

import shardwise as sw
from shardwise.models import hf_stages

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
             attn_implementation="sdpa", linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
             linear_value_head_dim=8, linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"])


def qwen3_next():
    return transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
        **SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        output_router_logits=True, router_aux_loss_coef=0.05))


def qwen3_5():
    return transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**SMALL))


@pytest.mark.parametrize("build,strategy", [
    (qwen3_next, {"pp": 2, "dp": 2, "dp_strategy": "zero3", "n_microbatches": 2}),
    (qwen3_5, {"pp": 2, "tp": 2}),
], ids=["qwen3_next", "qwen3_5"])
def test_a_linear_attention_hybrid_on_pipeline_stages_matches_one_process(build, strategy):
    assert build().config.layer_types[0] == "linear_attention"
    report = sw.check(build, left_padded, strategy=strategy, world_size=4, steps=2)
    assert report.ok, str(report)


def test_the_stages_give_the_linear_layer_the_padding_mask_and_the_attention_layer_the_causal_one():
    torch.manual_seed(0)
    model = qwen3_5()
    stages = hf_stages.llama_pipeline_layers(model)
    assert [stage.recurrent for stage in stages[1:-1]] == [True, False]
    batch = left_padded(0)
    hidden = stages[0](batch["input_ids"], attention_mask=batch["attention_mask"])
    for stage in stages[1:]:
        hidden = stage(**hidden) if isinstance(hidden, dict) else stage(hidden)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(hidden[real], model(**batch).logits[real], rtol=0, atol=0)


def test_packed_rows_are_refused_at_a_linear_attention_layer():
    stages = hf_stages.llama_pipeline_layers(qwen3_5())
    ids = torch.randint(0, 64, (1, 8))
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    hidden, positions = stages[0](ids, positions)
    with pytest.raises(ValueError, match="packed rows .* a linear-attention layer, whose recurrence would run from one "
                                         "document into the next"):
        stages[1](hidden, positions)
