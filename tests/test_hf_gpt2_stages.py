"""GPT-2-shaped HuggingFace decoders on pipeline stages (models/hf_gpt2_stages.py): GPT-BigCode (StarCoder's
multi-query attention, learned positions, a tied head), GPT-Neo (global and local layers, the window applied inside its
attention), GPT-J and CodeGen (no position embeddings: the blocks rotate by the position ids they are given; an
untied head with a bias). Refused before ("not a known HuggingFace decoder").

The stages' logits are the model's own, for whole rows and for packed rows (documents restarting their positions,
which GPT-J's rotary and GPT-Neo's position embeddings read); `sw.parallelize` trains each like one process with
HuggingFace's own loss over two AdamW steps (sw.check): pp=2 x dp=2 ZeRO-3 on packed rows, pp=2 on padded rows, and
GPT-BigCode, whose attention goes through transformers' AttentionInterface, pp=2 x cp=2 (ring) too."""

from __future__ import annotations

import pytest
import torch
from test_check_pipelines import packed, padded

import shardwise as sw
from shardwise.models import gpt2_pipeline_layers

transformers = pytest.importorskip("transformers")

NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
FAMILIES = {
    "gpt_bigcode": ("GPTBigCode", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, multi_query=True,
                                       **NO_DROPOUT)),
    "gpt_neo": ("GPTNeo", dict(hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=64, window_size=5,
                               attention_types=[[["global", "local"], 1]], embed_dropout=0.0, attention_dropout=0.0,
                               resid_dropout=0.0)),
    "gptj": ("GPTJ", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4, **NO_DROPOUT)),
    "codegen": ("CodeGen", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, n_ctx=64, rotary_dim=4,
                                **NO_DROPOUT)),
}


def builder(family, dtype=torch.float64):
    name, extra = FAMILIES[family]
    config = getattr(transformers, name + "Config")(vocab_size=64, attn_implementation="eager", **extra)
    return lambda: getattr(transformers, name + "ForCausalLM")(config).to(dtype)


def chain(layers, *inputs):
    out = layers[0](*inputs)
    for layer in layers[1:]:
        out = layer(*out) if isinstance(out, tuple) else layer(out)
    return out


@pytest.mark.parametrize("rows", ["whole", "packed"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_stages_give_the_models_own_logits(family, rows):
    torch.manual_seed(0)
    model = builder(family)().eval()
    assert model.config.model_type == family
    layers = gpt2_pipeline_layers(model)
    assert {id(p) for layer in layers for p in layer.parameters()} == {id(p) for p in model.parameters()}
    batch = packed(0)
    ids, positions = batch["input_ids"], batch["position_ids"]
    with torch.no_grad():
        if rows == "whole":
            got, want = chain(layers, ids), model(ids).logits
        else:  # packed rows: the model keeps the documents apart without a cache, as the stages do
            got, want = chain(layers, ids, positions), model(ids, position_ids=positions, use_cache=False).logits
            assert not torch.allclose(got, model(ids).logits)  # the documents change the logits
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


STRATEGIES = {"packed_pp2_dp2_zero3": (packed, {"pp": 2, "dp": 2, "dp_strategy": "zero3", "n_microbatches": 2}),
              "padded_pp2": (padded, {"pp": 2})}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_parallelize_trains_a_gpt2_shaped_family_like_one_process(family, strategy):
    batch, mesh = STRATEGIES[strategy]
    world = mesh["pp"] * mesh.get("dp", 1)
    report = sw.check(builder(family), batch, strategy=mesh, world_size=world, steps=2)
    assert report.ok, str(report)


def test_gpt_bigcode_with_context_parallel_on_pipeline_stages_matches_one_process():
    """The stages embed each token at its global position; the ring attention is causal over the whole sequence and
    keeps the padded rows' padding out."""
    report = sw.check(builder("gpt_bigcode"), padded, strategy={"pp": 2, "cp": 2}, world_size=4, steps=2)
    assert report.ok, str(report)
