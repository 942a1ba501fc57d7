"""HuggingFace decoders as pipeline layers (`shardwise.models.hf_stages`): the stage chain equals the model's own
logits (dense, tensor-parallel), `causal_lm_loss` equals HuggingFace's loss, and a 2-rank 1F1B pipeline trains
like one process running HuggingFace's forward and loss.

Thread ranks share torch's RNG, so every model is built once before launch and each rank gets a deep copy. The
pipeline parity uses AdamW eps=1e-5 as the tensor-parallel tests do (see test_tensor_parallel_hf_gpt2.py) and holds
the project's fp32 contract, rtol 1e-5 / atol 1e-6: microbatching only reorders sums, and after 3 steps the largest
difference measured is 1.2e-7 (parameters moved by 3e-3).
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from parity import ATOL, RTOL

import shardwise as sw
from shardwise import pipeline as pp
from shardwise import tensor_parallel as tp
from shardwise.models import causal_lm_loss, gpt2_pipeline_layers, llama_pipeline_layers

VOCAB, T, BATCH = 128, 16, 4
LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64)


def llama(layers=2, dtype=torch.float32, attention="sdpa", cls=transformers.LlamaForCausalLM,
          config=transformers.LlamaConfig, **overrides) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    sizes = {**LLAMA, "num_hidden_layers": layers, "tie_word_embeddings": False, **overrides}
    model = cls(config(**sizes)).to(dtype)
    model.set_attn_implementation(attention)
    return model


def gpt2(dtype=torch.float32, attention="sdpa") -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64, resid_pdrop=0,
                                     embd_pdrop=0, attn_pdrop=0, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).to(dtype)
    model.set_attn_implementation(attention)
    return model


def batch(vocab=VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, T), generator=torch.Generator().manual_seed(1))


def chain(layers, ids):
    x = ids
    for layer in layers:
        x = layer(x)
    return x


def assert_logits_equal(got, want):
    tol = 1e-12 if want.dtype == torch.float64 else 1e-6
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def param_ids(modules):
    return {id(p) for m in modules for p in m.parameters()}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_llama_stages_give_the_model_logits_with_its_own_parameters(attention, dtype):
    model, ids = llama(dtype=dtype, attention=attention), batch()
    layers = llama_pipeline_layers(model)
    assert len(layers) == 1 + model.config.num_hidden_layers + 1
    assert param_ids(layers) == param_ids([model])  # the model's own Parameters, every one of them
    assert layers[1].layer is model.model.layers[0] and layers[1].rotary_emb is model.model.rotary_emb
    with torch.no_grad():
        assert_logits_equal(chain(layers, ids), model(ids).logits)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_sliding_window_models_give_the_model_logits(kind, attention):
    # window 5 < T = 16, so the sliding window changes the result; Qwen2 mixes full and sliding layers.
    if kind == "mistral":
        model = llama(cls=transformers.MistralForCausalLM, config=transformers.MistralConfig, sliding_window=5,
                      dtype=torch.float64, attention=attention)
        windows = [5, 5]
    else:
        model = llama(3, cls=transformers.Qwen2ForCausalLM, config=transformers.Qwen2Config, use_sliding_window=True,
                      sliding_window=5, max_window_layers=1, dtype=torch.float64, attention=attention)
        windows = [None, 5, 5]
    ids, layers = batch(), llama_pipeline_layers(model)
    assert [layer.window for layer in layers[1:-1]] == windows
    with torch.no_grad():
        want = model(ids).logits
        assert_logits_equal(chain(layers, ids), want)
        for layer in layers[1:-1]:
            layer.window = None
        assert not torch.allclose(chain(layers, ids), want)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_gpt2_stages_give_the_model_logits_and_share_the_tied_embedding(attention, dtype):
    model, ids = gpt2(dtype, attention), batch(256)
    layers = gpt2_pipeline_layers(model)
    assert len(layers) == 4 and param_ids(layers) == param_ids([model])
    assert layers[0].wte.weight is layers[-1].lm_head.weight is model.transformer.wte.weight
    with torch.no_grad():
        assert_logits_equal(chain(layers, ids), model(ids).logits)


def test_causal_lm_loss_is_huggingfaces_loss():
    model, ids = llama(), batch()
    labels = ids.clone()
    labels[0, 3:7] = -100
    labels[2, -1] = -100
    for target in (ids, labels):
        out = model(ids, labels=target)
        torch.testing.assert_close(causal_lm_loss(out.logits, target), out.loss, rtol=0, atol=0)
    # HuggingFace computes its loss on logits.float(): in float64 it rounds to fp32; causal_lm_loss keeps float64.
    model64 = llama(dtype=torch.float64)
    out = model64(ids, labels=ids)
    assert causal_lm_loss(out.logits, ids).dtype == torch.float64
    torch.testing.assert_close(causal_lm_loss(out.logits.float(), ids), out.loss, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"labels shape \(4, 15\) does not match logits shape \(4, 16, 128\)"):
        causal_lm_loss(out.logits, ids[:, 1:])


def test_training_the_stages_gives_the_models_own_gradients():
    model, ids = llama(), batch()
    reference = copy.deepcopy(model)
    causal_lm_loss(chain(llama_pipeline_layers(model), ids), ids).backward()
    reference(ids, labels=ids).loss.backward()
    want = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name].grad, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_errors_name_the_problem():
    model = llama()
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel has no module 'transformer.embed_tokens'; expected a Llama"):
        llama_pipeline_layers(gpt2())
    with pytest.raises(ValueError, match=r"LlamaForCausalLM has no module 'transformer.wte'; expected a GPT-2"):
        gpt2_pipeline_layers(model)
    layers = llama_pipeline_layers(model)
    with pytest.raises(ValueError, match=r"input_ids must be an integer tensor of shape \(B, T\), got torch.float32"):
        layers[0](torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"T=65 exceeds the model's 64 positions"):
        gpt2_pipeline_layers(gpt2())[0](torch.zeros(1, 65, dtype=torch.long))
    model.config._attn_implementation = "flex_attention"  # switched after the stages were built: checked per call
    with pytest.raises(ValueError, match=r"attention implementation 'flex_attention' is not supported; allowed "
                                         r"\['eager', 'sdpa'\]"):
        layers[1](torch.zeros(1, 4, 64))
    with pytest.raises(ValueError, match="llama_pipeline_layers: attention implementation 'flex_attention'"):
        llama_pipeline_layers(model)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_stages_of_a_tensor_parallel_model_give_its_logits(family):
    dense = llama(dtype=torch.float64) if family == "llama" else gpt2(torch.float64)
    ids = batch(dense.config.vocab_size)
    with torch.no_grad():
        want = dense(ids).logits
    models = [copy.deepcopy(dense) for _ in range(2)]
    build = llama_pipeline_layers if family == "llama" else gpt2_pipeline_layers

    def body(comm):
        model = tp.parallelize(models[comm.rank], comm, plan=family)
        layers = build(model)  # after parallelize: the stages reference the tensor-parallel modules
        with torch.no_grad():
            return chain(layers, ids), model(ids).logits, type(model.get_submodule(
                "model.layers.0.self_attn.q_proj" if family == "llama" else "transformer.h.0.attn.c_attn")).__name__

    for got, own, layer_type in sw.launch(body, 2):
        assert "ColumnParallel" in layer_type
        assert_logits_equal(got, own)
        assert_logits_equal(got, want)


def train_reference(model, ids, steps):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5)
    for _ in range(steps):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_pipeline_1f1b_trains_like_one_process(family):
    steps = 3
    dense = llama(4) if family == "llama" else gpt2()
    ids = batch(dense.config.vocab_size)
    models = [copy.deepcopy(dense) for _ in range(2)]
    want = train_reference(dense, ids, steps)
    build = llama_pipeline_layers if family == "llama" else gpt2_pipeline_layers

    def body(comm):
        model = models[comm.rank]
        stages = pp.partition(build(model), n_stages=2)
        pipe = pp.Pipeline(stages, comm, schedule="1f1b", n_microbatches=4, loss_fn=causal_lm_loss)
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3, eps=1e-5)
        losses = []
        for _ in range(steps):
            losses.append(pipe.step(ids, ids).item())
            opt.step()
            opt.zero_grad()
        held = {id(p) for p in pipe.parameters()}
        # keep_vars: the state dict's tensors are the Parameters, so identity says which ones this rank trained
        state = model.state_dict(keep_vars=True)
        return losses, {name: t.detach().clone() for name, t in state.items() if id(t) in held}

    results = sw.launch(body, 2)
    trained = [set(state) for _, state in results]
    params = {name for name, t in dense.state_dict(keep_vars=True).items() if isinstance(t, torch.nn.Parameter)}
    assert trained[0] and trained[1] and trained[0] | trained[1] == params
    if family == "gpt2":  # the tied embedding is on both ranks, kept equal by the pipeline
        assert "transformer.wte.weight" in trained[0] and "lm_head.weight" in trained[1]
    else:
        assert not trained[0] & trained[1]
    assert results[0][0] == results[1][0]  # the mean loss, broadcast to every rank
    for _, state in results:
        for name, value in state.items():
            torch.testing.assert_close(value, want[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
