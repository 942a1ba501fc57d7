"""Context parallel on what HuggingFace decoders put in their attention: Gemma 2's soft-capped scores and GPT-OSS's
attention sinks (ring and Ulysses, float64 kernels against the eager formula, then both models' gradients against one
process), and the refusals for what it cannot make exact (an encoder, attention computed outside transformers'
AttentionInterface, a keyword it does not implement, chunk-local position_ids).

Before the soft cap and the sinks were implemented, both models trained silently wrong under cp: the attention
function dropped the ``softcap`` and ``s_aux`` keywords (Gemma 2's gradients off by up to 0.43; GPT-OSS's sinks
got no gradient at all), DeepSeek-V3's latent attention (values of another head size than the keys) failed, a
BERT trained with causal attention, and hybrid models (Jamba, Bamba, LFM2, Qwen3-Next,
RecurrentGemma) ran their state-space, convolution or linear-attention layers on each rank's chunks alone.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from attention_cases import HKV, SINKS, SOFTCAP, B, K, Q, T, cp_attention, eager_attention
from hf_cases import build, gemma2, gpt_oss, tiny_llama

import shardwise as sw
from shardwise import context_parallel as cp

transformers = pytest.importorskip("transformers")

@pytest.mark.parametrize("fn,world,zigzag", [(cp.ring_attention, 2, True), (cp.ring_attention, 4, True),
                                             (cp.ring_attention, 4, False), (cp.ulysses_attention, 2, True),
                                             (cp.ulysses_attention, 4, False)])
@pytest.mark.parametrize("softcap,sinks", [(SOFTCAP, None), (None, SINKS), (SOFTCAP, SINKS)])
def test_softcap_and_sinks_equal_the_eager_formula_float64(fn, world, zigzag, softcap, sinks):
    want = eager_attention(softcap, sinks)
    for got in sw.launch(cp_attention, world, fn, zigzag, softcap, sinks):
        for name, g, w in zip(("output", "dq", "dk", "dv", "dsinks"), got, want):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")


def sdpa_with_value_head(v):
    """torch's causal attention on the whole sequence with values of another head size: output and gradients."""
    q, k, v = (t.clone().requires_grad_() for t in (Q, K, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=out.dtype)
    out.backward(do)
    return [out.detach(), q.grad, k.grad, v.grad], do


@pytest.mark.parametrize("fn,world", [(cp.ring_attention, 2), (cp.ring_attention, 4), (cp.ulysses_attention, 2)])
def test_values_with_another_head_size_float64(fn, world):
    """DeepSeek's multi-head latent attention: q and k of head size 8 + 8 (no-rope and rope parts), v of 8; here
    q, k of 8 and v of 12, against torch's attention (it failed with "must agree in ... head_dim")."""
    v12 = torch.randn(B, HKV, T, 12, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    want, do = sdpa_with_value_head(v12)

    def body(comm):
        q_r, k_r, v_r, do_r = (cp.split_sequence(t, comm, dim=2).requires_grad_() for t in (Q, K, v12, do))
        out = fn(q_r, k_r, v_r, comm)
        out.backward(do_r.detach())
        return [cp.gather_sequence(t, comm, dim=2) for t in (out, q_r.grad, k_r.grad, v_r.grad)]

    for got in sw.launch(body, world):
        for name, g, w in zip(("output", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("fn,world,zigzag", [(cp.ring_attention, 2, True), (cp.ring_attention, 4, True),
                                             (cp.ring_attention, 4, False), (cp.ulysses_attention, 2, True)])
@pytest.mark.parametrize("window", [1, 3, 5, 9])
def test_a_sliding_window_equals_the_eager_formula_float64(fn, world, zigzag, window):
    """Query q sees keys q - window < k <= q. With T = 16 the chunks hold 2 to 8 tokens: window 1 (each token only
    itself: every off-diagonal block is skipped), 3 (shorter than a chunk: rows of a block with no visible key), 5
    and 9 (across chunk boundaries). The soft cap and sinks on too for the widest window."""
    softcap, sinks = (SOFTCAP, SINKS) if window == 9 else (None, None)
    want = eager_attention(softcap, sinks, window)
    for got in sw.launch(cp_attention, world, fn, zigzag, softcap, sinks, window):
        for name, g, w in zip(("output", "dq", "dk", "dv", "dsinks"), got, want):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")


def test_bad_softcap_and_sinks_raise():
    def body(comm):
        q = cp.split_sequence(Q, comm, dim=2)
        with pytest.raises(ValueError, match=r"softcap=-1.0 must be a positive number"):
            cp.ring_attention(q, q, q, comm, softcap=-1.0)
        with pytest.raises(ValueError, match=r"sinks must be a tensor of one logit per query head, shape \(4,\)"):
            cp.ulysses_attention(q, q, q, comm, sinks=torch.zeros(3))
        with pytest.raises(ValueError, match=r"window=0 must be a positive int"):
            cp.ring_attention(q, q, q, comm, window=0)

    sw.launch(body, 2)


# ---- HuggingFace models --------------------------------------------------------------------------------------------
IDS = torch.randint(1, 64, (2, 17), generator=torch.Generator().manual_seed(1))


def gradients(model, x, y):
    logits = model(input_ids=x).logits
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def deepseek_v3():
    """DeepSeek-V3: multi-head latent attention (values of head size 8, queries and keys of 8 + 8), routed experts
    with group-limited routing, a dense first layer."""
    return build(transformers.DeepseekV3ForCausalLM, transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        attn_implementation="eager"))


@pytest.mark.parametrize("model_of", [gemma2, gpt_oss, deepseek_v3])
@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_hf_gradients_match_one_process(model_of, method):
    x, y = IDS[:, :-1], IDS[:, 1:]
    want = gradients(model_of(), x, y)

    def body(comm):
        model = sw.DDP(cp.apply(model_of(), comm, method=method), comm, find_unused_parameters=True)
        return gradients(model, *cp.split_sequence((x, y), comm))

    for got in sw.launch(body, 2):
        for name, w in want.items():
            if w is None:  # an expert no token chose, in one process as under cp
                assert got[name] is None or not got[name].any(), name
                continue
            assert got[name] is not None, f"{name}: no gradient under context parallel"
            torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def llama_with_an_unread_window():
    """A Llama whose config carries a sliding_window that Llama never reads (configs converted from Mistral's)."""
    return build(transformers.LlamaForCausalLM, transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=4, attn_implementation="eager"))


def phimoe_windowed_by_its_mask():
    """Phi-MoE applies config.sliding_window to every layer through its mask alone (no keyword, no layer_types)."""
    return build(transformers.PhimoeForCausalLM, transformers.PhimoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=4, router_jitter_noise=0.0,
        input_jitter_noise=0.0, attention_dropout=0.0, attn_implementation="eager"))


@pytest.mark.parametrize("model_of", [llama_with_an_unread_window, phimoe_windowed_by_its_mask])
def test_a_config_window_applies_where_the_model_reads_it(model_of):
    """Before, any config.sliding_window of a model without layer_types windowed its attention under cp: a Llama
    carrying an unread one trained a windowed model, silently. Now only a model whose modeling file builds
    sliding-window masks (Phi-MoE) is windowed, as in one process."""
    x, y = IDS[:, :-1], IDS[:, 1:]
    want = gradients(model_of(), x, y)

    def body(comm):
        model = sw.DDP(cp.apply(model_of(), comm), comm, find_unused_parameters=True)
        return gradients(model, *cp.split_sequence((x, y), comm))

    for got in sw.launch(body, 2):
        for name, w in want.items():
            if w is not None:
                torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _llama_grads(model, x, y, autocast):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=x).logits
    F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_bf16_autocast_is_as_close_to_float32_as_one_process(method):
    """Under autocast a Llama's rotary embedding returns float32 q and k beside a bfloat16 v (it failed with "must
    agree in ... dtype"): the attention takes all three in bfloat16, as eager attention's matmuls do, and
    accumulates in float32. Its gradients are as far from float32's as one process's autocast gradients are."""
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1], ids[:, 1:]
    exact = _llama_grads(tiny_llama(), x, y, autocast=False)

    def worst(grads):
        return max(((grads[n] - exact[n]).abs().max() / exact[n].abs().max()).item() for n in exact)

    one_process = worst(_llama_grads(tiny_llama(), x, y, autocast=True))
    assert one_process > 1e-3  # autocast does change the gradients

    def body(comm):
        model = sw.DDP(cp.apply(tiny_llama(), comm, method=method), comm)
        return _llama_grads(model, *cp.split_sequence((x, y), comm), autocast=True)

    for grads in sw.launch(body, 2):
        assert worst(grads) < 2 * one_process


class HandRolledAttention(transformers.models.llama.modeling_llama.LlamaAttention):
    """A user's attention that computes softmax itself instead of calling the configured attention function."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, k, v = (p(hidden_states).view(shape).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).flatten(2)), None


def test_what_cannot_be_exact_is_refused():
    bert = build(transformers.BertForMaskedLM, transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        attention_probs_dropout_prob=0.0, attn_implementation="eager"))
    falcon = build(transformers.FalconForCausalLM, transformers.FalconConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, attention_dropout=0.0))
    lfm2 = build(transformers.Lfm2ForCausalLM, transformers.Lfm2Config(  # a short convolution before the attention
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["conv", "full_attention"], attn_implementation="eager"))
    shifted = tiny_llama()  # a user's token-shift convolution inside a layer
    shifted.model.layers[0].shift = torch.nn.Conv1d(64, 64, 2, groups=64)

    def body(comm):
        with pytest.raises(ValueError, match=r"BertSelfAttention\) attends both ways \(is_causal=False"):
            cp.apply(bert, comm)
        with pytest.raises(ValueError, match=r"FalconAttention\) computes attention itself, not through"):
            cp.apply(falcon, comm)
        with pytest.raises(ValueError, match=r"Lfm2ForCausalLM mixes tokens along the sequence outside attention "
                                             r"\(config.layer_types has \['conv'\]"):
            cp.apply(lfm2, comm)
        with pytest.raises(ValueError, match=r"model.layers.0.shift is a Conv1d \(in LlamaDecoderLayer\)"):
            cp.apply(shifted, comm)
        x = cp.split_sequence(IDS[:, :16], comm)
        model = cp.apply(tiny_llama(), comm)
        with pytest.raises(ValueError, match=r"LlamaAttention passes \['relative_bias'\] to its attention function"):
            model(input_ids=x, relative_bias=torch.zeros(1))  # HF forwards unknown keywords to the attention
        with pytest.raises(ValueError, match=r"position_ids are 0..7 on every rank, positions within each rank.s "
                                             r"chunks"):
            model(input_ids=x, position_ids=torch.arange(8).expand(2, -1))
        model(input_ids=x, position_ids=cp.sequence_positions(8, comm).expand(2, -1))  # the global ones pass
        with pytest.raises(ValueError, match=r"generate\(\) extends sequences one token at a time"):
            model.generate(x, max_new_tokens=2)
        sharing = transformers.LlamaForCausalLM(model.config)  # an RLHF reference built from the prepared config
        with pytest.raises(ValueError, match=r"built from the config object of a model apply prepared"):
            sharing(input_ids=x)
        hand = tiny_llama()
        for layer in hand.model.layers:
            layer.self_attn.__class__ = HandRolledAttention
        hand = cp.apply(hand, comm)
        with pytest.raises(ValueError, match=r"HandRolledAttention ran without calling the attention function"):
            hand(input_ids=x)

    sw.launch(body, 2)


def test_a_model_sharing_the_config_object_stays_a_plain_model():
    """An RLHF reference or an evaluation copy built from the same config object as the trained model: apply used to
    select ring attention in that shared object, so the other model's first forward failed ("which
    shardwise.context_parallel.apply did not prepare"). apply gives the model a config of its own (every module that
    held the old one holds the copy); the other model keeps its attention and its logits, the prepared one runs ring
    attention over its chunks."""
    with torch.no_grad():
        want = tiny_llama()(IDS[:, :16]).logits
    policies = [tiny_llama() for _ in range(2)]  # built here: thread ranks share torch's global RNG
    references = [type(policy)(policy.config) for policy in policies]  # each the same config object as its policy
    for policy, reference in zip(policies, references):
        reference.load_state_dict(policy.state_dict())

    def body(comm):
        policy, reference = policies[comm.rank], references[comm.rank]
        model = cp.apply(policy, comm)
        with torch.no_grad():
            chunks = model(input_ids=cp.split_sequence(IDS[:, :16], comm)).logits
            mine = reference(IDS[:, :16]).logits
        shared = [name for name, m in model.named_modules() if vars(m).get("config") is reference.config]
        return (model.config is not reference.config, reference.config._attn_implementation, shared,
                cp.gather_sequence(chunks, comm), mine)

    for separate, implementation, shared, whole, mine in sw.launch(body, 2):
        assert separate and implementation == "eager" and shared == []
        torch.testing.assert_close(mine, want, rtol=0, atol=0)
        torch.testing.assert_close(whole, want, rtol=1e-5, atol=1e-5)
