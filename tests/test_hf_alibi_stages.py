"""BLOOM and MPT on pipeline stages (models/hf_alibi_stages.py; refused before: "not a known HuggingFace decoder").

Their attention adds linear biases per head (ALiBi) that their forwards build once for every layer: BLOOM's from the
padding mask, MPT's for config.max_seq_len positions. The stages' logits are each model's own for whole and
left-padded rows (at the tokens), and `sw.parallelize` trains each like one process with HuggingFace's loss
(sw.check, two AdamW steps) on pp2 x dp2 ZeRO-3 with padded rows and on pp2; with the biases zeroed the first loss
(or gradient) differs."""

from __future__ import annotations

import pytest
import torch
from test_check_pipelines import padded

import shardwise as sw
from shardwise.models.hf_alibi_stages import alibi_pipeline_layers

transformers = pytest.importorskip("transformers")


def bloom(dtype=torch.float64):
    config = transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=4, n_head=4, hidden_dropout=0.0,
                                      attention_dropout=0.0, attn_implementation="eager")
    return transformers.BloomForCausalLM(config).to(dtype)


def mpt(dtype=torch.float64):
    config = transformers.MptConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=4, max_seq_len=64, resid_pdrop=0.0,
                                    emb_pdrop=0.0, attn_implementation="eager")
    return transformers.MptForCausalLM(config).to(dtype)


BUILD = {"bloom": bloom, "mpt": mpt}


def chain(layers, first):
    out = layers[0](**first)
    for layer in layers[1:]:
        out = layer(*out) if isinstance(out, tuple) else layer(**out) if isinstance(out, dict) else layer(out)
    return out


@pytest.mark.parametrize("rows", ["whole", "left_padded"])
@pytest.mark.parametrize("family", list(BUILD))
def test_the_stages_give_the_models_own_logits(family, rows):
    torch.manual_seed(0)
    # float32 for left padding: in float64 the eager mask's min plus a score overflows to -inf on the padding's own
    # rows, whose NaN outputs then reach the tokens as values (in transformers itself)
    model = BUILD[family](torch.float64 if rows == "whole" else torch.float32).eval()
    assert model.config.model_type == family
    layers = alibi_pipeline_layers(model)
    assert {id(p) for layer in layers for p in layer.parameters()} == {id(p) for p in model.parameters()}
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    given = {"input_ids": ids}
    if rows == "left_padded":
        mask = torch.ones_like(ids)
        mask[0, :3], mask[2, :9] = 0, 0
        given["attention_mask"] = mask
    with torch.no_grad():
        got, want = chain(layers, given), model(**given).logits
    real = given.get("attention_mask", torch.ones_like(ids)).bool()
    tolerance = 1e-10 if rows == "whole" else 1e-5
    torch.testing.assert_close(got[real], want[real], rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("strategy", [
    {"pp": 2, "dp": 2, "dp_strategy": "zero3", "n_microbatches": 2},
    {"pp": 2},
], ids=["pp2_dp2_zero3", "pp2"])
@pytest.mark.parametrize("family", list(BUILD))
def test_parallelize_trains_an_alibi_decoder_like_one_process(family, strategy):
    world = strategy["pp"] * strategy.get("dp", 1)
    report = sw.check(BUILD[family], padded, strategy=strategy, world_size=world, steps=2)
    assert report.ok, str(report)


@pytest.mark.parametrize("family", list(BUILD))
def test_the_biases_are_what_is_checked(family, monkeypatch):
    """With every bias zeroed the stages train another model: sw.check says so at the first step."""
    from shardwise.models import hf_alibi_stages

    forward = hf_alibi_stages.AlibiBlockStage.forward

    def unbiased(self, *args, **kwargs):
        builder = self._biases
        self._biases = lambda *a, **k: builder(*a, **k) * 0
        try:
            return forward(self, *args, **kwargs)
        finally:
            self._biases = builder

    monkeypatch.setattr(hf_alibi_stages.AlibiBlockStage, "forward", unbiased)
    report = sw.check(BUILD[family], padded, strategy={"pp": 2}, world_size=2, steps=1)
    assert not report.ok and report.first_mismatch.step == 0
