"""Expert parallel on the HuggingFace MoE families whose experts compute Mixtral's or GPT-OSS's formula
(experts/hf_kinds.py): Qwen3-MoE, Qwen2-MoE (a shared expert beside the routed ones, sigmoid-gated) and GPT-OSS
(biased experts, an interleaved clamped SwiGLU, a biased router) with their load-balancing loss on, and DeepSeek-V3
(group-limited routing, a dense first layer, a shared expert). Each trains 3 AdamW steps (weight
decay, a binding `sw.clip_grad_norm_`) at ep 2 under DDP, and at ep 2 x edp 2 under ZeRO-3, against one process on
the global batch: every parameter, and the ranks' losses averaging to one process's (the load-balancing loss made
the global batch's). Experts modules or models that compute something else are refused by name, with what differs.

Before hf_kinds.py these experts were refused by class name (only ``MixtralExperts`` was accepted).
"""

from __future__ import annotations

import threading

import pytest
import torch
from parity import value_error_text
from test_experts_hf import own_loss_granite_moe

import shardwise as sw
from shardwise.experts import expert_parallel

transformers = pytest.importorskip("transformers")

STEPS, GLOBAL_BATCH, MAX_NORM = 3, 8, 0.5
_BUILD = threading.Lock()  # HuggingFace initialises from torch's global RNG, which thread ranks share
COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=32, attn_implementation="eager", tie_word_embeddings=False)
CONFIGS = {
    "qwen3_moe": (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig, dict(
        num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        output_router_logits=True, router_aux_loss_coef=0.05)),
    "qwen2_moe": (transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig, dict(
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, output_router_logits=True, router_aux_loss_coef=0.05)),
    "gpt_oss": (transformers.GptOssForCausalLM, transformers.GptOssConfig, dict(
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
        router_aux_loss_coef=0.05)),
    "deepseek_v3": (transformers.DeepseekV3ForCausalLM, transformers.DeepseekV3Config, dict(
        num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)),
}


def build(kind, **changes):
    cls, config_cls, options = CONFIGS[kind]
    with _BUILD:
        torch.manual_seed(0)
        return cls(config_cls(**{**COMMON, **options, **changes}))


def batch(step, rank=0, world=1):
    ids = torch.randint(0, 64, (GLOBAL_BATCH, 12), generator=torch.Generator().manual_seed(4000 + step))
    ids = ids[rank * GLOBAL_BATCH // world:(rank + 1) * GLOBAL_BATCH // world]
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}


def train(model, step_batch, clip):
    opt, norms, losses = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5, weight_decay=0.1), [], []
    for step in range(STEPS):
        out = model(**step_batch(step))
        out.loss.backward()
        norms.append(float(clip(model)))
        losses.append(float(out.loss.detach()))
        opt.step()
        opt.zero_grad()
    return norms, losses


def run_ep(comm, kind, strategy):
    mesh = sw.Mesh(comm, ep=2)
    model = expert_parallel(build(kind), mesh)
    if strategy == "ddp":
        model = sw.DDP(model, mesh.dp_cp, find_unused_parameters=True)  # an expert no token chose has no gradient
    else:
        model = sw.ZeRO(model, mesh.dp_cp, stage=3)
    norms, losses = train(model, lambda step: batch(step, mesh.coords.dp, mesh.dp.size),
                          lambda m: sw.clip_grad_norm_(m, MAX_NORM))
    return sw.full_state_dict(model), norms, losses


@pytest.mark.parametrize("kind", list(CONFIGS))
@pytest.mark.parametrize("world,strategy", [(2, "ddp"), (4, "zero3")], ids=["ep2-ddp", "ep2-edp2-zero3"])
def test_three_adamw_steps_equal_one_process(kind, world, strategy):
    model = build(kind)
    want_norms, want_losses = train(model, batch, lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM))
    assert min(want_norms) > MAX_NORM  # the clipping binds
    want = model.state_dict()
    results = sw.launch(run_ep, world, kind, strategy)
    for state, norms, _ in results:
        assert norms == pytest.approx(want_norms, rel=1e-5)
        assert sorted(state) == sorted(want)
        for name, value in want.items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    dp = world // 2  # ranks at one ep coordinate hold different rows; their mean loss is one process's
    for step in range(STEPS):
        mean = sum(r[2][step] for r in results) / len(results)
        assert mean == pytest.approx(want_losses[step], rel=1e-5), (dp, step)


class DoubledExperts(transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts):
    """A user's experts class whose forward differs from Mixtral's (the flags and parameters are the same)."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return 2 * super().forward(hidden_states, top_k_index, top_k_weights)


def test_what_computes_something_else_is_refused():
    biased = build("qwen3_moe", router_aux_loss_coef=0.0)
    biased.model.layers[0].mlp.experts.has_bias = True  # a flag that selects another formula in transformers
    doubled = build("qwen3_moe", router_aux_loss_coef=0.0)
    for layer in doubled.model.layers:
        layer.mlp.experts.__class__ = DoubledExperts
    granite = own_loss_granite_moe(transformers.GraniteMoeConfig(  # a router loss of its own code
        **{**COMMON, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
           "output_router_logits": True, "router_aux_loss_coef": 0.05}))

    def body(comm):
        mesh = sw.Mesh(comm, ep=2)
        return [value_error_text(lambda: expert_parallel(m, mesh)) for m in (biased, doubled, granite)]

    for bias, dbl, gran in sw.launch(body, 4):
        assert "Qwen3MoeExperts" in bias and "has_bias=True (the mixtral template's: has_bias=False)" in bias
        assert "DoubledExperts" in dbl and "its eager forward is neither Mixtral's, GPT-OSS's nor Llama 4's" in dbl
        assert "OwnLossGraniteMoe" in gran and "router_aux_loss_coef=0.05" in gran
