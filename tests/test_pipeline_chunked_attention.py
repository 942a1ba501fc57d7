"""Pipeline stages for Llama 4 (text): its chunked-attention layers (``layer_types`` "chunked_attention") attend
within chunks of ``attention_chunk_size`` tokens, counted as transformers counts them -- from each row's first token
after its left padding, or from each packed document's start (hf_stage_inputs.CausalMasks) -- beside full-attention
layers without rotary embeddings (NoPE, with their temperature tuning) and its experts. Chunks of 4 tokens in rows of
16: the stages' logits are transformers' bit for bit on whole, left-padded and packed rows, and `sw.check` trains
pp2 x dp2 ZeRO-3 (left padding) and pp2 x tp2 (packed rows) like one process."""

from __future__ import annotations

import pytest
import torch
from test_labels_at_padding import left_padded

import shardwise as sw
from shardwise.models import hf_stages

transformers = pytest.importorskip("transformers")


def llama4():
    return transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, intermediate_size_mlp=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=1, attention_chunk_size=4,
        layer_types=["chunked_attention", "full_attention"], no_rope_layers=[1, 0], floor_scale=4,
        attn_implementation="sdpa"))


def packed(step):
    """4 rows of two documents each (6 and 10 tokens), marked by position ids restarting at 0."""
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step))
    positions = torch.cat([torch.arange(6), torch.arange(10)]).repeat(4, 1)
    labels = ids.clone()
    labels[:, 6] = -100  # the second document's first token, as DataCollatorWithFlattening marks it
    return {"input_ids": ids, "position_ids": positions, "labels": labels, "use_cache": False}


@pytest.mark.parametrize("rows", ["whole", "left_padded", "packed"])
def test_the_stages_give_transformers_logits_bit_for_bit(rows):
    torch.manual_seed(0)
    model = llama4().double()
    stages = hf_stages.llama_pipeline_layers(model)
    assert [stage.chunk for stage in stages[1:-1]] == [4, None]
    batch = {"whole": {"input_ids": packed(0)["input_ids"]}, "left_padded": left_padded(0), "packed": packed(0)}[rows]
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "position_ids", "attention_mask")}
    hidden = stages[0](**inputs)
    for stage in stages[1:]:
        hidden = stage(**hidden) if isinstance(hidden, dict) else stage(*hidden) if isinstance(hidden, tuple) \
            else stage(hidden)
    want = model(**inputs, use_cache=False).logits
    real = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()
    torch.testing.assert_close(hidden[real], want[real], rtol=0, atol=0)


@pytest.mark.parametrize("batch,strategy", [
    (left_padded, {"pp": 2, "dp": 2, "dp_strategy": "zero3", "n_microbatches": 2}),
    (packed, {"pp": 2, "tp": 2}),
], ids=["left_padded-pp2xdp2", "packed-pp2xtp2"])
def test_llama4_on_pipeline_stages_matches_one_process(batch, strategy):
    report = sw.check(llama4, batch, strategy=strategy, world_size=4, steps=2)
    assert report.ok, str(report)
