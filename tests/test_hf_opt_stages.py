"""OPT on pipeline stages (models/hf_opt_stages.py; refused before: "not a known HuggingFace decoder").

OPT counts each row's positions from its first token that is not padding (``cumsum(attention_mask) - 1``), so a
left-padded row's logits depend on the mask through the position embeddings too, not only through attention. The
stages' logits are the model's own for whole, left-padded and packed rows, with OPT-350m's shape (word embeddings
narrower than the model, projected in and out; the final norm off) and OPT-1.3b's and larger (the final norm on);
`sw.parallelize` trains it like one process with HuggingFace's loss (sw.check, two AdamW steps) on pp2 x cp2 (ring:
the positions read from the whole sequence's mask, gathered) and pp2 x dp2 ZeRO-3 with left-padded rows. Packed rows
(position ids restarting at each document): the stages keep the documents apart, as transformers does under flash
attention; OPT's eager and SDPA masks ignore the position ids (hf_packing.py), so there the logits are compared with the
model given the documents' mask."""

from __future__ import annotations

import pytest
import torch
from test_check_pipelines import packed

import shardwise as sw
from shardwise.models.hf_opt_stages import opt_pipeline_layers

transformers = pytest.importorskip("transformers")

SHAPES = {
    "opt-350m": dict(word_embed_proj_dim=16, do_layer_norm_before=False),
    "opt-1.3b": dict(do_layer_norm_before=True),
}


def builder(shape, attention="eager", **extra):
    config = transformers.OPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=4, ffn_dim=64,
                                    num_attention_heads=4, max_position_embeddings=64, dropout=0.0,
                                    attention_dropout=0.0, layerdrop=0.0, attn_implementation=attention,
                                    **SHAPES[shape], **extra)
    return lambda: transformers.OPTForCausalLM(config).double()


def left_padded(step):
    """8 rows of 16 tokens, rows 0 and 5 padded on the left (by 3 and 9); labels -100 at the padding and on each
    padded row's first token (a label scored at a padding position is refused under the stages)."""
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(step))
    mask = torch.ones_like(ids)
    mask[0, :3], mask[5, :9] = 0, 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 3], labels[5, 9] = -100, -100
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def chain(layers, first):
    out = layers[0](**first)
    for layer in layers[1:]:
        out = layer(*out) if isinstance(out, tuple) else layer(**out) if isinstance(out, dict) else layer(out)
    return out


def document_mask(positions, dtype=torch.float64):
    """The additive (B, 1, T, T) mask keeping packed documents apart (causal within each): OPT's own mask ignores the
    position ids (hf_packing.py), so one process is given this one, as the stages build it."""
    documents = (torch.diff(positions, prepend=positions[:, :1] - 1) != 1).cumsum(-1)
    T = positions.shape[1]
    causal = torch.arange(T)[None, :] <= torch.arange(T)[:, None]
    visible = (documents[:, :, None] == documents[:, None, :]) & causal
    hidden = torch.full(visible.shape, torch.finfo(dtype).min, dtype=dtype)
    return torch.where(visible, torch.zeros((), dtype=dtype), hidden).unsqueeze(1)


@pytest.mark.parametrize("rows", ["whole", "left_padded", "packed"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_stages_give_the_models_own_logits(shape, rows):
    torch.manual_seed(0)
    model = builder(shape, "sdpa")().eval()
    layers = opt_pipeline_layers(model)
    assert {id(p) for layer in layers for p in layer.parameters()} == {id(p) for p in model.parameters()}
    if rows == "whole":
        given = {"input_ids": left_padded(0)["input_ids"]}
    elif rows == "left_padded":
        given = {k: v for k, v in left_padded(0).items() if k != "labels"}
    else:
        given = {k: v for k, v in packed(0).items() if k in ("input_ids", "position_ids")}
    with torch.no_grad():
        got = chain(layers, given)
        if rows == "packed":  # the stages keep the documents apart; OPT's forward given their mask does too
            want = model(**given, attention_mask=document_mask(given["position_ids"]), use_cache=False).logits
            assert not torch.allclose(got, model(**given, use_cache=False).logits)  # its own mask lets them mix
        else:
            want = model(**given, use_cache=False).logits
    real = given["attention_mask"].bool() if "attention_mask" in given else torch.ones(got.shape[:2], dtype=torch.bool)
    torch.testing.assert_close(got[real], want[real], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("strategy", [
    {"pp": 2, "cp": 2},
    {"pp": 2, "dp": 2, "dp_strategy": "zero3", "n_microbatches": 2},
], ids=["pp2_cp2", "pp2_dp2_zero3"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_parallelize_trains_opt_with_left_padded_rows_like_one_process(shape, strategy):
    report = sw.check(builder(shape, "sdpa"), left_padded, strategy=strategy, world_size=4, steps=2)
    assert report.ok, str(report)


def test_layerdrop_is_refused_by_name():
    with pytest.raises(ValueError, match=r"layerdrop=0.5 \(decoder layers skipped at random in training\)"):
        opt_pipeline_layers(transformers.OPTForCausalLM(transformers.OPTConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4, layerdrop=0.5)))
