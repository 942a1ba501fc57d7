"""HuggingFace models composed: `LlamaForCausalLM` as tp2 x pp2 through `sw.parallelize`, and GPT-2 (Conv1D layers)
as tp2 x dp2 (tensor parallel + DDP) and tp2 x pp2, each trained with clipping at a binding max-norm, match one
process trained with HuggingFace's own loss. Random weights, small configs; each rank's model is a copy of one
model built before launch (thread ranks share torch's RNG)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import shardwise as sw
from shardwise import tensor_parallel as tp

STEPS, MAX_NORM, B, T = 4, 0.5, 8, 16


def llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False, attn_implementation="eager")
    return transformers.LlamaForCausalLM(config)


def gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64, resid_pdrop=0,
                                     embd_pdrop=0, attn_pdrop=0, attn_implementation="eager")
    return transformers.GPT2LMHeadModel(config)


def ids(step, rank=0, parts=1):
    full = torch.randint(0, 128, (B, T), generator=torch.Generator().manual_seed(100 + step))
    return full.chunk(parts)[rank]


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-5)


def dense(model):
    opt = optimizer(model.parameters())
    norms = []
    for step in range(STEPS):
        x = ids(step)
        model(x, labels=x).loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def hybrid_body(comm, model, sizes, plan):
    dp, tp_size, pp_size = sizes
    mesh = sw.Mesh(comm, dp=dp, tp=tp_size, pp=pp_size)
    hybrid = sw.parallelize(copy.deepcopy(model), mesh, tp_plan=plan, n_microbatches=2)
    opt = optimizer(hybrid.parameters())
    norms = []
    for step in range(STEPS):
        x = ids(step, mesh.coords.dp, dp)
        hybrid.step(x, x)
        norms.append(float(sw.clip_grad_norm_(hybrid, MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return sw.full_state_dict(hybrid), norms


def check(results, want, want_norms):
    assert min(want_norms) > MAX_NORM
    for state, norms in results:
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(want_norms), rtol=1e-5, atol=0)
        assert state.keys() == want.keys()
        for name in want:
            assert state[name].shape == want[name].shape, name
            torch.testing.assert_close(state[name], want[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("build, plan", [(llama, "llama"), (gpt2, "gpt2")], ids=["llama", "gpt2"])
def test_tp2_pp2_matches_one_process(build, plan):
    model = build()
    want, norms = dense(copy.deepcopy(model))
    check(sw.launch(hybrid_body, 4, model, (1, 2, 2), plan), want, norms)


def test_gpt2_tp2_dp2_with_ddp_and_clipping():
    model = gpt2()
    want, want_norms = dense(copy.deepcopy(model))

    def body(comm):
        mesh = sw.Mesh(comm, dp=2, tp=2)
        parallel = sw.DDP(tp.parallelize(copy.deepcopy(model), mesh.tp, "gpt2"), mesh.dp)
        opt = optimizer(parallel.parameters())
        norms = []
        for step in range(STEPS):
            x = ids(step, mesh.coords.dp, 2)
            parallel(x, labels=x).loss.backward()
            norms.append(float(sw.clip_grad_norm_(parallel, MAX_NORM)))
            opt.step()
            opt.zero_grad()
        return sw.full_state_dict(parallel, rank0_only=False), norms

    check(sw.launch(body, 4), want, want_norms)


def padded_batch(step):
    """Rows padded to unequal lengths (-100 labels): the dp ranks and microbatches hold different label counts."""
    x = ids(step)
    y = x.clone()
    for row, length in enumerate((16, 3, 9, 12, 5, 16, 7, 2)):
        y[row, length:] = -100
    return x, y


@pytest.mark.parametrize("sizes", [(2, 1, 2, 1), (2, 1, 1, 2)], ids=["dp2xpp2", "dp2xcp2"])
def test_padded_labels_train_as_one_process_on_the_global_batch(sizes):
    """HuggingFace's loss over the step's global batch (models/hf_parallel.py GlobalCausalLMLoss): before, each
    microbatch and dp rank averaged its own labels, 0.0057 off one process after three steps."""
    model = llama()
    dense_model = copy.deepcopy(model)
    opt = optimizer(dense_model.parameters())
    want_losses = []
    for step in range(3):
        x, y = padded_batch(step)
        loss = dense_model(x, labels=y).loss
        want_losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    dp, tp_size, pp_size, cp = sizes

    def body(comm):
        mesh = sw.Mesh(comm, dp=dp, tp=tp_size, pp=pp_size, cp=cp)
        hybrid = sw.parallelize(copy.deepcopy(model), mesh, n_microbatches=2)
        hopt = optimizer(hybrid.parameters())
        losses = []
        for step in range(3):
            x, y = padded_batch(step)
            losses.append(hybrid.step(x.chunk(dp)[mesh.coords.dp], y.chunk(dp)[mesh.coords.dp]).item())
            hopt.step()
            hopt.zero_grad()
        return sw.full_state_dict(hybrid), losses, mesh.coords.dp

    results = sw.launch(body, dp * tp_size * pp_size * cp)
    by_dp = {coord: losses for _, losses, coord in results}
    assert [sum(step) / dp for step in zip(*by_dp.values())] == pytest.approx(want_losses, rel=1e-5)
    want = dense_model.state_dict()
    for state, _, _ in results:
        for name in want:
            torch.testing.assert_close(state[name], want[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
