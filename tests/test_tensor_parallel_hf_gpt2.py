"""Plan "gpt2": HuggingFace's GPT2LMHeadModel (Conv1D layers, fused qkv, lm_head tied to wte) under tensor
parallelism, trained with HuggingFace's own loss, against the dense model.

Thread ranks share torch's RNG and HuggingFace models are not built concurrently here: every rank gets a deep copy
of one dense model made before launch (`copies`), so all ranks start from the same weights as the reference.
The fp32 training tests use AdamW eps=1e-5 for the reason test_tensor_parallel_gpt.py gives (tensor parallelism
splits the reduction dimension of every matmul; Adam's first step amplifies that rounding noise by lr / eps) and
hold the project's fp32 contract, rtol 1e-5 / atol 1e-6 (measured max |diff| 2.7e-7 after 3 steps, tp=2 and 2x2).
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from parity import ATOL, RTOL

import shardwise as sw
from shardwise.sharded_tensor import local
from shardwise import tensor_parallel as tp
from shardwise.models import GPT, GPTConfig

D, LAYERS, HEADS, VOCAB, T, BATCH, STEPS = 64, 2, 4, 256, 16, 4, 3


def config(**overrides) -> transformers.GPT2Config:
    sizes = dict(n_embd=D, n_layer=LAYERS, n_head=HEADS, vocab_size=VOCAB, n_positions=64, resid_pdrop=0,
                 embd_pdrop=0, attn_pdrop=0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2Config(**{**sizes, **overrides})


def dense(dtype=torch.float32, **overrides) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config(**overrides)).to(dtype)


def copies(model, n):
    return [copy.deepcopy(model) for _ in range(n)]


def batch(rank=0, parts=1):
    ids = torch.randint(0, VOCAB, (BATCH, T), generator=torch.Generator().manual_seed(1))
    return ids.chunk(parts)[rank]


def train(model, ids, steps=STEPS):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5)
    for _ in range(steps):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model


def assert_state_close(got, want, rtol, atol):
    assert list(got) == list(want)
    for name in want:
        assert got[name].shape == want[name].shape, name
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def test_forward_logits_and_hf_loss_equal_the_dense_model():
    base = dense(torch.float64)
    ids = batch()
    with torch.no_grad():
        out = base(ids, labels=ids)

    def body(comm, models):
        model = tp.parallelize(models[comm.rank], comm, plan="gpt2")
        attn, h0 = model.transformer.h[0].attn, model.transformer.h[0]
        layout = {"c_attn": type(attn.c_attn).__name__, "c_proj": type(attn.c_proj).__name__,
                  "c_fc": type(h0.mlp.c_fc).__name__, "mlp.c_proj": type(h0.mlp.c_proj).__name__,
                  "wte": type(model.transformer.wte).__name__, "lm_head": type(model.lm_head).__name__,
                  "tied": model.lm_head.weight is model.transformer.wte.weight,
                  "sizes": (attn.split_size, attn.num_heads, attn.embed_dim, attn.head_dim),
                  "c_attn.weight": tuple(local(attn.c_attn.weight).shape),
                  "wte.weight": tuple(local(model.transformer.wte.weight).shape),
                  # what the slices answer for: the dense Conv1D (in, out) and embedding shapes
                  "c_attn.whole": tuple(attn.c_attn.weight.shape), "wte.whole": tuple(model.transformer.wte.weight.shape)}
        state = tp.full_state_dict(model)
        with torch.no_grad():
            got = model(ids, labels=ids)
        return layout, state, got.logits, got.loss

    for layout, state, logits, loss in sw.launch(body, 2, copies(base, 2)):
        assert layout == {"c_attn": "Conv1DColumnParallelLinear", "c_proj": "Conv1DRowParallelLinear",
                          "c_fc": "Conv1DColumnParallelLinear", "mlp.c_proj": "Conv1DRowParallelLinear",
                          "wte": "VocabParallelEmbedding", "lm_head": "ColumnParallelLinear", "tied": True,
                          "sizes": (D // 2, HEADS // 2, D // 2, D // HEADS),
                          "c_attn.weight": (3 * D // 2, D), "wte.weight": (VOCAB // 2, D),
                          "c_attn.whole": (D, 3 * D), "wte.whole": (VOCAB, D)}
        # the gathered state is the dense one, HuggingFace names and Conv1D (in, out) shapes included
        assert_state_close(state, base.state_dict(), rtol=0, atol=0)
        torch.testing.assert_close(logits, out.logits, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(loss, out.loss, rtol=1e-12, atol=1e-12)


def train_tp(comm, models, dp):
    """tp=2 over the ranks of each dp group; with dp=2, sw.DDP over the dp axis and half the batch per dp rank."""
    mesh = sw.Mesh(comm, dp=dp, tp=2)
    model = tp.parallelize(models[comm.rank], mesh.tp, plan="gpt2")
    if dp > 1:
        model = sw.DDP(model, mesh.dp)
    train(model, batch(mesh.coords.dp, dp))
    return tp.full_state_dict(model)


@pytest.mark.parametrize("dp", [1, 2], ids=["tp2", "dp2xtp2"])
def test_three_adamw_steps_match_the_dense_model(dp):
    base = dense()
    want = train(copy.deepcopy(base), batch()).state_dict()  # one process, the global batch
    for state in sw.launch(train_tp, 2 * dp, copies(base, 2 * dp), dp):
        assert_state_close(state, want, rtol=RTOL, atol=ATOL)


def test_errors_are_value_errors_naming_the_numbers():
    # built before launch (see the module docstring); every check raises before the model is touched
    gpt2, gpt = dense(), GPT(GPTConfig.preset("tiny"), seed=0)
    odd = {"n_inner": dense(n_inner=66), "vocab": dense(vocab_size=250), "cross": dense(add_cross_attention=True)}

    def body(comm):
        if comm.size == 3:
            with pytest.raises(ValueError, match=r"tp size 3 does not divide the number of attention heads n_head=4"):
                tp.parallelize(gpt2, comm, plan="gpt2")
            return
        with pytest.raises(ValueError, match=r"tp size 4 does not divide the MLP hidden size n_inner=66"):
            tp.parallelize(odd["n_inner"], comm, plan="gpt2")
        with pytest.raises(ValueError, match=r"tp size 4 does not divide the vocabulary size vocab_size=250; pad .*"
                                             r"resize_token_embeddings\(252\)"):
            tp.parallelize(odd["vocab"], comm, plan="gpt2")
        with pytest.raises(ValueError, match=r"plan='gpt2' needs a HuggingFace GPT-2 model .* got GPT;"):
            tp.parallelize(gpt, comm, plan="gpt2")
        with pytest.raises(ValueError, match=r"plan='gpt2' does not support sequence_parallel=True \(HuggingFace's "
                                             r"GPT2Model adds the position embeddings"):
            tp.parallelize(gpt2, comm, plan="gpt2", sequence_parallel=True)
        with pytest.raises(ValueError, match=r"plan='gpt2' does not support cross-attention"):
            tp.parallelize(odd["cross"], comm, plan="gpt2")
        with pytest.raises(ValueError, match=r"plan='gpt-2' is not a built-in plan; allowed \['gpt', 'gpt2', 'hf', 'llama'\]"):
            tp.parallelize(gpt2, comm, plan="gpt-2")
        assert getattr(gpt2, "_shardwise_tp", None) is None  # nothing was replaced

    sw.launch(body, 3)
    sw.launch(body, 4)
