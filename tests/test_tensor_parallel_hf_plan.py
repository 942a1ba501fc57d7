"""Plan "hf": the tensor-parallel plan a HuggingFace model ships in its config, read in shardwise's styles
(tensor_parallel/hf_plan.py).

Before, GPT-NeoX, Phi and Nemotron had no tensor-parallel plan here ("pass a plan dict"), and HuggingFace's own
plan, passed as a dict, was refused for its style names. Each family is checked against one process through
`sw.check` (two AdamW steps with weight decay): the plain styles (GPT-NeoX's fused per-head query_key_value, Phi,
Nemotron), the gathered ones (OLMo 2's q/k/v, Phi-3's fused qkv_proj and gate_up_proj), HuggingFace's
"replicated_with_grad_allreduce" per-head norms (Qwen 3), experts kept whole with the patterns of a family's other
variants skipped (Qwen 3 MoE), a head tied to the embedding, an attention's per-head sinks split with its heads
("local_params" and the sinks "colwise": Granite SWA), with ZeRO-3 over dp and on pipeline stages; and what
it cannot map is refused by name: a style it does not know, a model without a plan, and the one plan HuggingFace
ships that trains wrong (Apertus's, which leaves the activation's learned scalars out) at the first step.
"""

from __future__ import annotations

import pytest
import torch
from test_check_pipelines import padded

import shardwise as sw
from shardwise import tensor_parallel as tp
from shardwise.planner import model_facts

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager")
FAMILIES = {
    "gptneox": ("GPTNeoX", {"rotary_pct": 0.5}),
    "phi": ("Phi", {"partial_rotary_factor": 0.5}),
    "nemotron": ("Nemotron", {}),
    "olmo2": ("Olmo2", {}),
    "phi3": ("Phi3", {"pad_token_id": 0}),
    "qwen3": ("Qwen3", {"head_dim": 8}),
    "qwen3_moe": ("Qwen3Moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                               "head_dim": 8}),
    "llama_tied": ("Llama", {"tie_word_embeddings": True}),
    # its attention's sinks (one logit per head): "local_params" with the sinks "colwise" (refused before)
    "granite_swa": ("GraniteSWA", {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 0}),
}


def build(family):
    name, extra = FAMILIES[family]
    config = getattr(transformers, f"{name}Config")(**{**SMALL, **extra})
    return lambda: getattr(transformers, f"{name}ForCausalLM")(config)


def batch(step):
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_familys_own_plan_trains_like_one_process(family):
    report = sw.check(build(family), batch, strategy="tp:hf", world_size=2, steps=2, optimizer=adamw)
    assert report.ok, str(report)


@pytest.mark.parametrize("family, mesh", [
    ("gptneox", {"tp": 2, "dp": 2, "dp_strategy": "zero3"}),
    ("olmo2", {"tp": 2, "pp": 2}),
], ids=["gptneox-tp2xzero3", "olmo2-tp2xpp2"])
def test_the_hf_plan_composes_with_the_other_axes(family, mesh):
    data = padded if "pp" in mesh else batch
    report = sw.check(build(family), data, strategy={**mesh, "tp_plan": "hf"}, world_size=4, steps=2,
                      optimizer=adamw)
    assert report.ok, str(report)


def test_the_styles_map_and_a_tied_head_stays_whole_with_its_embedding():
    styles = tp.plans.builtin_plan("hf", build("olmo2")(), 2)
    assert styles["model.layers.*.self_attn.q_proj"] == tp.Colwise(gather_output=True)
    assert styles["model.layers.*.self_attn.o_proj"] == tp.Rowwise(input_is_parallel=False)
    assert styles["lm_head"] == tp.Colwise(gather_output=True)
    assert tp.plans.builtin_plan("hf", build("qwen3")(), 2)["model.layers.*.self_attn.q_norm"] == tp.Heads()
    moe = tp.plans.builtin_plan("hf", build("qwen3_moe")(), 2)
    assert not any("experts" in pattern or pattern.endswith("mlp.gate_proj") for pattern in moe)
    assert "lm_head" not in tp.plans.builtin_plan("hf", build("llama_tied")(), 2)


def test_a_model_with_a_plan_but_no_built_in_one_defaults_to_it():
    assert model_facts(build("gptneox")()).tp_plan == "hf"
    assert model_facts(build("qwen3")()).tp_plan == "llama"  # the llama plan knows it: it splits more
    report = sw.check(build("phi"), batch, strategy="tp", world_size=2, steps=1, optimizer=adamw)
    assert report.ok, str(report)


def test_a_style_it_does_not_map_and_a_model_without_a_plan_are_refused_by_name():
    model = build("llama_tied")()
    model.config.base_model_tp_plan = {"layers.*.self_attn.k_proj": "mla_kv_a_proj",
                                       "layers.*.self_attn.q_proj": "colwise"}
    with pytest.raises(ValueError, match="'mla_kv_a_proj'.*plan 'llama' splits DeepSeek-V3"):
        tp.plans.builtin_plan("hf", model, 2)
    bloom = transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=1,
                                                                   n_head=4))
    with pytest.raises(ValueError, match="plan='hf' needs a HuggingFace model whose config carries"):
        tp.plans.builtin_plan("hf", bloom, 2)


def test_apertus_own_plan_leaves_its_activation_scalars_out_and_is_refused_at_the_first_step():
    """Its own plan is refused at the first step; plan "llama" places the scalars, and is Apertus's default plan (the
    one `sw.check("tp")`, `sw.parallelize(tp=...)` and `sw.distribute` take)."""
    config = transformers.ApertusConfig(**SMALL)
    with pytest.raises(ValueError, match="mlp.act_fn.alpha_p"):
        sw.check(lambda: transformers.ApertusForCausalLM(config), batch, strategy="tp:hf", world_size=2, steps=1,
                 optimizer=adamw)
    for strategy in ("tp:llama", "tp"):
        report = sw.check(lambda: transformers.ApertusForCausalLM(config), batch, strategy=strategy, world_size=2,
                          steps=1, optimizer=adamw)
        assert report.ok, str(report)


def test_an_attention_parameter_the_plan_leaves_whole_beside_split_heads_is_refused_by_name():
    """Doge's own plan splits q/k/v by heads and leaves the attention's per-head `A` whole: the forward failed with
    a shape error ("The size of tensor a (2) must match the size of tensor b (4)"); now the plan is refused,
    naming the parameter. A plan that leaves the attention whole (an MLP-only plan, as Flint's) passes."""
    model = transformers.DogeForCausalLM(transformers.DogeConfig(**{**SMALL, "head_dim": 8}))
    with pytest.raises(ValueError, match=r"self_attn.A \(2,\) is a parameter of the attention "
                                         r"model.layers.0.self_attn \(DogeAttention\).*tp=1"):
        tp.plans.builtin_plan("hf", model, 2)
    model.config.base_model_tp_plan = {k: v for k, v in model.config.base_model_tp_plan.items()
                                       if ".self_attn." not in k}
    assert not any(".self_attn." in pattern for pattern in tp.plans.builtin_plan("hf", model, 2))
