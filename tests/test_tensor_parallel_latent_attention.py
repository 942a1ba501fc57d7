"""DeepSeek-V3's multi-head latent attention under tensor parallel (tensor_parallel/latent_attention.py).

Before, the "llama" plan failed on DeepSeek-V3 ("plan pattern 'q_proj' matches no module"). Now its up projections
are split by heads and its down projections stay whole, with the rope key every head shares summed over the group in
the backward pass (without that, kv_a_proj_with_mqa's gradient was 20x off). Checked against one process through
`sw.check` with padded rows: tp=2 with and without a query latent, and tp with pp, dp x ep and cp on four ranks;
GLM-4-MoE-Lite (DeepSeek-V3's forward), DeepSeek-V2 and MiniCPM3 (forwards of their own around DeepSeek-V3's
expand_kv) on tp=2 and tp2 x pp2.
"""

from __future__ import annotations

import pytest
from test_check_pipelines import padded
from test_parallelize_hf_families import FAMILIES, SMALL, builder

import shardwise as sw
from shardwise import tensor_parallel as tp
from shardwise.tensor_parallel.llama_plan import llama_plan

transformers = pytest.importorskip("transformers")


def _deepseek(**changes):
    config = transformers.DeepseekV3Config(**{**SMALL, **FAMILIES["deepseek_v3"][1], **changes})
    return lambda: transformers.DeepseekV3ForCausalLM(config)


@pytest.mark.parametrize("q_lora_rank", [16, None], ids=["query_latent", "q_proj"])
def test_latent_attention_trains_like_one_process_under_the_llama_plan(q_lora_rank):
    report = sw.check(_deepseek(q_lora_rank=q_lora_rank), padded, strategy="tp:llama", world_size=2, steps=2)
    assert report.ok, str(report)


@pytest.mark.parametrize("mesh", [{"tp": 2, "pp": 2}, {"tp": 2, "dp": 2, "ep": 2}, {"tp": 2, "cp": 2}],
                         ids=["tp2xpp2", "tp2xdp2xep2", "tp2xcp2"])
def test_latent_attention_with_the_other_axes(mesh):
    report = sw.check(builder("deepseek_v3"), padded, strategy=mesh, world_size=4, steps=2)
    assert report.ok, str(report)


def test_a_latent_attention_whose_forward_is_deepseek_v3s_trains_like_one_process():
    """GLM-4-MoE-Lite's attention runs DeepSeek-V3's forward byte for byte (refused before as unknown)."""
    config = transformers.Glm4MoeLiteConfig(**{**SMALL, **FAMILIES["deepseek_v3"][1]})
    report = sw.check(lambda: transformers.Glm4MoeLiteForCausalLM(config), padded, strategy="tp:llama", world_size=2,
                      steps=2)
    assert report.ok, str(report)


@pytest.mark.parametrize("family", ["DeepseekV2", "MiniCPM3"])
def test_deepseek_v2s_and_minicpm3s_latent_attention_train_like_one_process_with_tp_and_pp(family):
    """Their attention forwards rotate the rope parts their own way (DeepSeek-V2: a complex product) around
    DeepSeek-V3's expand_kv; refused before as unknown to plan 'llama' (and their own plan 'hf' names mla_kv_a_proj,
    which it does not map). Their default plan is now 'llama'."""
    extra = {k: v for k, v in FAMILIES["deepseek_v3"][1].items() if k in (
        "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
        "pad_token_id")}
    if family == "DeepseekV2":
        extra.update(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
                     first_k_dense_replace=1, n_group=1, topk_group=1)
    config = getattr(transformers, family + "Config")(**{**SMALL, **extra})
    build = lambda: getattr(transformers, family + "ForCausalLM")(config)  # noqa: E731
    report = sw.check(build, padded, strategy={"tp": 2, "pp": 2}, world_size=4, steps=2)
    assert report.ok, str(report)
    assert "tp" in report.strategy


def test_an_unknown_latent_attention_is_refused_by_name():
    model = _deepseek()()
    attn = model.model.layers[1].self_attn
    dense = type(attn)

    def forward(self, *args, **kwargs):  # a forward of its own: what it computes is not read
        return dense.forward(self, *args, **kwargs)

    attn.__class__ = type("MyLatentAttention", (dense,), {"forward": forward})
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn \(MyLatentAttention\) is a latent attention the "
                                         r"plan does not know \(it splits DeepseekV3Attention\)"):
        tp.parallelize(model, sw.init(), "llama")


def test_a_tp_size_that_does_not_divide_the_heads_is_refused():
    with pytest.raises(ValueError, match=r"tp size 3 does not divide the number of attention heads of "
                                         r"model.layers.0.self_attn \(num_heads\)=4"):
        llama_plan(_deepseek()(), 3)


def test_a_plan_dict_splitting_the_latent_attention_gets_the_rope_keys_sum_too():
    """The rope key's reduction follows the split, not the plan's name: a dict naming the up projections trains like
    one process (before it, such a plan trained kv_a_proj_with_mqa on each rank's heads' part of the gradient)."""
    plan = {"q_b_proj": "colwise", "kv_b_proj": "colwise", "o_proj": "rowwise"}
    report = sw.check(builder("deepseek_v3"), padded, strategy={"tp": 2, "tp_plan": plan}, world_size=2, steps=2)
    assert report.ok, str(report)
