"""The model given to `sw.parallelize`, after the call: what a script ends with reads the trained model or refuses.

Under pp = 2 each rank trains half the layers and keeps untrained copies of the others: `model.save_pretrained(out)`
wrote those copies without an error, and `sw.full_state_dict(model)` returned them. Under ZeRO-3 both failed with
errors about views of a piece. Now the tools given the model answer for the HybridModel (`sw.full_state_dict(model)`
is the trained model's), `save_pretrained` without a full state dict refuses naming the recipe, the recipe writes
the trained weights (reloaded with `from_pretrained`), and under pp > 1 `model.state_dict()` and `model(x)` refuse.
With pp = 1 and DDP the model holds the trained parameters and saves and runs as before.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hf_decoders import llama
from parity import value_error_text

import shardwise as sw
from shardwise.models import GPT, GPTConfig

transformers = pytest.importorskip("transformers")

IDS = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))


def trained(comm, model, axes, options):
    hybrid = sw.parallelize(model, sw.Mesh(comm, **axes), **options)
    opt = torch.optim.AdamW(hybrid.parameters(), lr=1e-2, weight_decay=0.1)
    hybrid.step(IDS, IDS)
    opt.step()
    return hybrid


def test_pipeline_save_pretrained_refuses_and_the_recipe_writes_the_trained_model(tmp_path):
    """pp = 2: save_pretrained, state_dict() and a call refuse; sw.full_state_dict(model) is the trained model, which
    the recipe writes and from_pretrained reads back."""
    plain = llama()
    before = {k: v.clone() for k, v in plain.state_dict().items()}

    def body(comm):
        model = copy.deepcopy(plain)
        hybrid = trained(comm, model, {"pp": 2}, {"n_microbatches": 2})
        errors = [value_error_text(lambda: model.save_pretrained(tmp_path / f"stale{comm.rank}")),
                  value_error_text(lambda: model.state_dict()),
                  value_error_text(lambda: model(IDS))]
        state = sw.full_state_dict(model)  # every rank: the tools given the model answer for the hybrid
        if comm.rank == 0:
            model.save_pretrained(tmp_path / "out", state_dict=dict(state))  # transformers empties the dict it writes
        comm.barrier()
        return errors, state, sw.full_state_dict(hybrid)

    results = sw.launch(body, 2)
    saved = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    for (save, state_dict, call), state, of_hybrid in results:
        assert "several pipeline ranks" in save and "sw.full_state_dict(model)" in save
        assert "LlamaForCausalLM was given to sw.parallelize" in state_dict and "sw.full_state_dict" in state_dict
        assert "hybrid.predict" in call
        assert set(state) == set(before)
        for name, value in state.items():
            assert torch.equal(value, of_hybrid[name]) and torch.equal(saved[name], value), name
        assert all(not torch.equal(state[n], before[n]) for n in ("model.layers.0.mlp.up_proj.weight",
                                                                    "model.layers.1.mlp.up_proj.weight"))
    assert not (tmp_path / "stale0").exists() and not (tmp_path / "stale1").exists()


@pytest.mark.parametrize("axes,options", [({"dp": 2}, {"dp_strategy": "zero3"}), ({"pp": 2}, {"n_microbatches": 2})])
def test_the_whole_model_tools_given_the_model_answer_for_the_hybrid(tmp_path, axes, options):
    """ZeRO-3: save_pretrained names the recipe (it failed on a view of a piece). Both layouts: the full state dict,
    the clip's norm and a checkpoint taken through the model are the hybrid's (the checkpoint reloads into a fresh
    hybrid bit for bit)."""
    plain = llama()

    def body(comm):
        model = copy.deepcopy(plain)
        hybrid = trained(comm, model, axes, options)
        error = value_error_text(lambda: model.save_pretrained(tmp_path / "unused"))
        norms = float(sw.clip_grad_norm_(model, 1e9)), float(sw.clip_grad_norm_(hybrid, 1e9))
        sw.save_checkpoint(tmp_path / "ckpt", model)
        again = sw.parallelize(copy.deepcopy(plain), sw.Mesh(comm, **axes), **options)
        sw.load_checkpoint(tmp_path / "ckpt", again)
        return error, sw.full_state_dict(model), sw.full_state_dict(hybrid), norms, sw.full_state_dict(again)

    for error, state, of_hybrid, (norm, of_hybrid_norm), reloaded in sw.launch(body, 2):
        if "dp" in axes:
            assert "split over ranks" in error and "sw.full_state_dict(model)" in error
        assert set(state) == set(of_hybrid) == set(reloaded)
        assert all(torch.equal(v, of_hybrid[k]) and torch.equal(v, reloaded[k]) for k, v in state.items())
        assert norm == of_hybrid_norm > 0


def test_with_ddp_the_model_holds_the_trained_parameters_and_runs(tmp_path):
    plain = llama()

    def body(comm):
        model = copy.deepcopy(plain)
        hybrid = trained(comm, model, {"dp": 2}, {})
        hybrid.eval()
        with torch.no_grad():
            logits = model(IDS).logits
        if comm.rank == 0:
            model.save_pretrained(tmp_path / "out")
        comm.barrier()
        return logits, hybrid.predict(IDS), sw.full_state_dict(hybrid)

    for logits, predicted, state in sw.launch(body, 2):
        torch.testing.assert_close(logits, predicted)
        saved = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").state_dict()
        assert all(torch.equal(saved[k], v) for k, v in state.items())


def test_the_shardwise_gpt_under_a_pipeline_refuses_its_state_dict_too():
    config = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2, tie_weights=False)

    def body(comm):
        model = GPT(config, seed=0)
        hybrid = sw.parallelize(model, sw.Mesh(comm, pp=2), n_microbatches=2)
        return value_error_text(lambda: model.state_dict()), set(sw.full_state_dict(model)), \
            set(sw.full_state_dict(hybrid))

    for error, names, of_hybrid in sw.launch(body, 2):
        assert "GPT was given to sw.parallelize" in error
        assert names == of_hybrid == set(GPT(config, seed=0).state_dict())


def test_the_hybrid_of_a_huggingface_model_saves_pretrained_from_every_rank(tmp_path):
    """A script that kept only the hybrid (``model = sw.parallelize(model, mesh)``) calls save_pretrained on every
    rank, as transformers' Trainer and accelerate do; rank 0 writes the trained model. The GPT's hybrid has none."""
    plain = llama()

    def body(comm):
        model = trained(comm, copy.deepcopy(plain), {"pp": 2}, {"n_microbatches": 2})
        model.save_pretrained(tmp_path / "out")
        gpt = sw.parallelize(GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2), seed=0),
                             sw.Mesh(comm, pp=2), n_microbatches=2)
        return sw.full_state_dict(model), hasattr(gpt, "save_pretrained")

    results = sw.launch(body, 2)
    saved = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    assert transformers.AutoConfig.from_pretrained(tmp_path / "out").architectures == ["LlamaForCausalLM"]
    for state, gpt_has_it in results:
        assert set(saved) == set(state) and all(torch.equal(saved[k], v) for k, v in state.items())
        assert not gpt_has_it
