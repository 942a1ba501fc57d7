"""Gradients accumulated over several pipeline steps before one optimizer step, with a weight tied across stages.

A script that accumulates (calls `model.step` k times, then `opt.step()`) must get one process's sum of the k
gradients. A weight tied across pipeline ranks (the GPT's embedding and head, GPT-2's `wte` and `lm_head`) is summed
over its holders at every step; summing the accumulated gradient again at the next step counted the earlier steps
once per holder (the embedding was off by 0.039 after two updates, pipeline/tied.py now sums each step's own part).
Three AdamW updates (weight decay) of two accumulated steps each, against one process; the gradients are zeroed both
ways (set to None, and in place)."""

from __future__ import annotations

import copy

import pytest
import torch
from float64_gpts import ROWS, tied_gpt
from float64_gpts import adamw as optimizer
from float64_gpts import tokens as batch

import shardwise as sw
from shardwise.models import lm_loss

UPDATES, ACCUMULATE = 3, 2


def one_process(model, loss_of):
    """The state after UPDATES updates, each of the mean of ACCUMULATE steps' losses."""
    opt = optimizer(model.parameters())
    for update in range(UPDATES):
        for k in range(ACCUMULATE):
            (loss_of(model, batch(update * ACCUMULATE + k)) / ACCUMULATE).backward()
        opt.step()
        opt.zero_grad(set_to_none=update % 2 == 0)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def accumulated(model, run_step, rows=slice(None)):
    """The same on a pipeline: `run_step(x, y)` per step, the accumulated gradients scaled to the steps' mean."""
    opt = optimizer(model.parameters())
    for update in range(UPDATES):
        for k in range(ACCUMULATE):
            x, y = batch(update * ACCUMULATE + k)
            run_step(x[rows], y[rows])
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(ACCUMULATE)
        opt.step()
        opt.zero_grad(set_to_none=update % 2 == 0)
    return sw.full_state_dict(model)


def assert_equal_states(got, want, tolerance=1e-10):
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name].double(), want[name].double(), rtol=tolerance, atol=tolerance, msg=name)


@pytest.mark.parametrize("dp_strategy", ["ddp", "zero3"])
def test_parallelize_accumulates_a_weight_tied_across_stages_like_one_process(dp_strategy):
    want = one_process(tied_gpt(), lambda model, b: model(*b))

    def body(comm):
        mesh = sw.Mesh(comm, dp=None, pp=2)
        model = sw.parallelize(tied_gpt(), mesh, dp_strategy=dp_strategy, n_microbatches=2)
        rows = ROWS // mesh.sizes["dp"]
        return accumulated(model, model.step, slice(mesh.coords.dp * rows, (mesh.coords.dp + 1) * rows))

    for got in sw.launch(body, 4):
        assert_equal_states(got, want)


def test_a_pipeline_built_by_hand_accumulates_its_tie_like_one_process():
    trained = tied_gpt()
    one_process(trained, lambda model, b: model(*b))
    # A pipeline's full state dict names each stage's layers (stages.<s>.<layer>.<name>): the same split of the
    # trained model names them alike.
    want = {f"stages.{s}.{name}": value for s, stage in enumerate(sw.pipeline.partition(trained.pipeline_layers(), 2))
            for name, value in stage.state_dict().items()}

    def body(comm):
        stages = sw.pipeline.partition(tied_gpt().pipeline_layers(), comm.size)
        pipe = sw.pipeline.Pipeline(stages, comm, "1f1b", 2, lm_loss)
        return accumulated(pipe, pipe.step)

    for got in sw.launch(body, 2):
        assert_equal_states(got, want)


transformers = pytest.importorskip("transformers")


def gpt2():  # tie_word_embeddings (GPT-2's default): wte in the first stage, lm_head in the last
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=64, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    return transformers.GPT2LMHeadModel(config).double()


def test_a_huggingface_model_tied_across_stages_accumulates_like_one_process():
    built = gpt2()  # built once: thread ranks share torch's global random generator
    want = one_process(copy.deepcopy(built), lambda model, b: model(b[0], labels=b[0]).loss)

    def body(comm):
        model = sw.parallelize(copy.deepcopy(built), sw.Mesh(comm, pp=2), n_microbatches=2)
        return accumulated(model, lambda x, y: model.step(x, x))

    for got in sw.launch(body, 2):  # transformers computes its loss in float32 (logits.float()), here as there
        assert_equal_states(got, want, 1e-6)
