"""`HybridModel.state_dict()` / `load_state_dict()` under the names of the model given to `sw.parallelize`
(hybrid_state.py), as a script that kept ``model = sw.parallelize(model, mesh)`` saves and loads.

* pp = 1 under DDP: the state dict has the plain model's keys in its order (a tied weight under each name), and
  ``torch.save`` of it on rank 0 loads into the plain model, equal to `sw.full_state_dict` after an AdamW step.
* pp = 1 under ZeRO-3 and tensor parallel: the same keys; pickling a piece raises naming `sw.full_state_dict`.
* pp = 2: `state_dict()` raises naming `sw.full_state_dict` (a rank holds part of the model); `load_state_dict` of a
  one-process state dict loads every stage, under DDP and ZeRO-3, GPT-2 with its head tied to the embedding too.
* strict: a missing or unknown name raises on every rank (whichever holds the layer) before anything is loaded;
  strict=False returns them."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import shardwise as sw
from shardwise.models import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)  # tied embedding and head
BASE = GPT(CONFIG, seed=0)
OTHER = GPT(CONFIG, seed=1)


def _rows(step, rank, ranks):
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step))
    return x[rank * 4 // ranks:(rank + 1) * 4 // ranks]


def _saved_after_a_step(comm):
    mesh = sw.Mesh(comm, dp=2)
    model = sw.parallelize(copy.deepcopy(BASE), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    x = _rows(0, mesh.coords.dp, 2)
    model.step(x, x)
    opt.step()
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return list(model.state_dict()), buffer.getvalue(), sw.full_state_dict(model)


def test_pp1_ddp_state_dict_is_the_plain_models_and_loads_into_it():
    for keys, saved, full in sw.launch(_saved_after_a_step, 2):
        assert keys == list(BASE.state_dict())
        plain = GPT(CONFIG, seed=2)
        plain.load_state_dict(torch.load(io.BytesIO(saved)))  # strict: every name of the plain model
        assert plain.tok_emb.weight is plain.head.weight
        for name, value in plain.state_dict().items():
            torch.testing.assert_close(value, full[name], rtol=0, atol=0)
        assert not torch.equal(full["tok_emb.weight"], BASE.tok_emb.weight)  # the step changed it


@pytest.mark.parametrize("axes,options", [({"dp": 2}, {"dp_strategy": "zero3"}), ({"tp": 2}, {"tp_plan": "gpt"})],
                         ids=["zero3", "tp2"])
def test_pp1_pieces_keep_the_plain_names_and_refuse_pickling(axes, options):
    def body(comm):
        model = sw.parallelize(copy.deepcopy(BASE), sw.Mesh(comm, **axes), **options)
        with pytest.raises(RuntimeError, match="sw.full_state_dict"):
            torch.save(model.state_dict(), io.BytesIO())
        return list(model.state_dict())

    for keys in sw.launch(body, 2):
        assert keys == list(BASE.state_dict())


@pytest.mark.parametrize("options", [{}, {"dp_strategy": "zero3"}], ids=["ddp", "zero3"])
def test_pp2_loads_a_one_process_state_dict_into_every_stage_and_refuses_a_partial_save(options):
    def body(comm):
        model = sw.parallelize(copy.deepcopy(BASE), sw.Mesh(comm, dp=2, pp=2), **options)
        with pytest.raises(ValueError, match=r"pp=2.*sw\.full_state_dict\(model\)"):
            model.state_dict()
        result = model.load_state_dict(OTHER.state_dict())
        return result, sw.full_state_dict(model)

    for result, full in sw.launch(body, 4):
        assert result.missing_keys == [] and result.unexpected_keys == []
        for name, value in OTHER.state_dict().items():
            torch.testing.assert_close(full[name], value, rtol=0, atol=0)


def test_a_missing_or_unknown_name_raises_on_every_pipeline_rank():
    partial = {k: v for k, v in OTHER.state_dict().items() if k != "blocks.0.attn.qkv.weight"}  # a stage-0 layer
    extra = {**OTHER.state_dict(), "blocks.9.mlp.weight": torch.zeros(1)}

    def body(comm):
        model = sw.parallelize(copy.deepcopy(BASE), sw.Mesh(comm, pp=2))
        errors = []
        for state in (partial, extra):
            with pytest.raises(RuntimeError) as raised:
                model.load_state_dict(state)
            errors.append(str(raised.value))
        untouched = torch.equal(sw.full_state_dict(model)["blocks.1.mlp.fc.weight"], BASE.blocks[1].mlp.fc.weight)
        return errors, model.load_state_dict(partial, strict=False), untouched

    for (missing, unexpected), loose, untouched in sw.launch(body, 2):
        assert untouched  # a refused state dict loads nothing
        assert "Missing key(s) in state_dict: 'blocks.0.attn.qkv.weight'" in missing
        assert "Unexpected key(s) in state_dict: 'blocks.9.mlp.weight'" in unexpected
        assert loose.missing_keys == ["blocks.0.attn.qkv.weight"] and loose.unexpected_keys == []


def test_huggingface_gpt2_with_its_tied_head_loads_through_pp2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=32,
                                     attn_implementation="eager")
    base, other = transformers.GPT2LMHeadModel(config), transformers.GPT2LMHeadModel(config)
    want = {k: v.clone() for k, v in other.state_dict().items()}

    def body(comm):
        model = sw.parallelize(copy.deepcopy(base), sw.Mesh(comm, pp=2))
        model.load_state_dict(want)
        return sw.full_state_dict(model)

    for full in sw.launch(body, 2):
        for name, value in want.items():
            torch.testing.assert_close(full[name], value, rtol=0, atol=0)
