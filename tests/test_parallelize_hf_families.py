"""The HuggingFace decoder families `sw.parallelize` splits into pipeline stages as it splits Llama
(models/hf_families.py, ``LLAMA_SHAPED``: a forward of embedding, decoder layers, norm and head, plus at most an
embedding multiplier, a logit transform and rotary embeddings per layer type), each through `sw.check` on pp=2 x dp=2
(ZeRO-3) or pp=2 x cp=2 (ring) with padded rows, against one process with HuggingFace's own loss over two AdamW steps:
OLMo (clipped qkv), OLMo 2 (q/k norms), OLMo 3 (sliding layers with their own rotary), OLMoE and Phi-MoE (their router
losses, per microbatch), Phi-3 (a sliding window of 5 on 16 tokens, partial rotary), Helium, EXAONE 4 (sliding layers
every other layer), GLM (partial rotary), SmolLM3 (layers without rotary), StarCoder2 (a window; LayerNorm; its
embedding dropout is the first stage's), Gemma 2 (attention and final soft caps, a window), Gemma 3 (local layers
rotating by their own base), Granite (embedding, residual, attention multipliers and a logit scale), Granite-MoE
(Granite's with Mixtral's router loss, per microbatch), Cohere (a logit scale), Cohere 2 (its scale, sliding layers
that alone rotate), Ministral (sliding and full layers by layer type), Phi (its final norm named final_layernorm,
LayerNorms, partial rotary), DeepSeek-V3 (latent attention with a value head of another size, a dense first layer,
routed and shared experts, split over ep=2 x dp=2), Nemotron, StableLM, Persimmon (final_layernorm), MiniMax-M2
(Mixtral's router loss), Hunyuan V3 (shared experts), MiniCPM3 (its head's input divided by logits_scaling), HyperCLOVA
X (an embedding multiplier, logits times logits_scaling), nanochat (its final norm before the layers too, soft-capped
logits), GPT-NeoX (Pythia: its base model gpt_neox, embed_in, final_layer_norm, parallel residual), CWM (Ministral's
forward, Llama 3's rope scaling), Cohere 2 MoE (Cohere 2's with experts, split over ep=2 x dp=2), EXAONE-MoE (EXAONE
4's sliding layers, a dense first layer, shared experts), Mellum (sliding layers rotating by their own base, its
router loss per microbatch), AFMoE (GPT-OSS's forward with muP's input scaling by sqrt(hidden size)) and Granite SWA
and its MoE (Granite's multipliers and logit scale, each layer rotating by its own base, some by none), Falcon (its
own module names, alibi=None, three layer variants). Seven families
transformers generates from listed ones (their forwards a listed family's byte code: hf_families.pipeline_kinds) the
same way. JetMoE, not known to be Llama-shaped, is refused by name."""

from __future__ import annotations

import pytest
import torch
from test_check_pipelines import padded

import shardwise as sw
from shardwise.models import hf_stages

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, attn_implementation="eager")
MOE_LOSS = dict(output_router_logits=True, router_aux_loss_coef=0.05)
_GRANITE_SWA = dict(num_hidden_layers=4, sliding_window=5, embedding_multiplier=3.0, logits_scaling=4.0,
                    residual_multiplier=0.5, attention_multiplier=0.3, layer_rope_theta=[10000.0, 0.0, 500.0, 0.0],
                    layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"])
FAMILIES = {
    "olmo": ("Olmo", {"clip_qkv": 0.5}, "zero3"),
    "olmo2": ("Olmo2", {}, "cp"),
    "olmoe": ("Olmoe", {"num_experts": 4, "num_experts_per_tok": 2, **MOE_LOSS}, "zero3"),
    "phimoe": ("Phimoe", {"num_local_experts": 4, "num_experts_per_tok": 2, "router_jitter_noise": 0.0,
                          "sliding_window": None, **MOE_LOSS}, "cp"),
    "phi3": ("Phi3", {"pad_token_id": 0, "sliding_window": 5, "partial_rotary_factor": 0.5}, "zero3"),
    "helium": ("Helium", {"head_dim": 8}, "cp"),
    "exaone4": ("Exaone4", {"num_hidden_layers": 4, "sliding_window": 5, "sliding_window_pattern": 2}, "zero3"),
    "glm": ("Glm", {"head_dim": 8, "pad_token_id": 0}, "cp"),
    "smollm3": ("SmolLM3", {"pad_token_id": 0, "no_rope_layer_interval": 2}, "zero3"),
    "starcoder2": ("Starcoder2", {"sliding_window": 5}, "cp"),
    "olmo3": ("Olmo3", {"num_hidden_layers": 4, "sliding_window": 5}, "cp"),
    "gemma2": ("Gemma2", {"head_dim": 8, "final_logit_softcapping": 0.5, "attn_logit_softcapping": 2.0,
                          "sliding_window": 5}, "zero3"),
    "gemma3_text": ("Gemma3Text", {"num_hidden_layers": 4, "head_dim": 8, "final_logit_softcapping": 0.5,
                                   "sliding_window": 5, "rope_local_base_freq": 100.0}, "cp"),
    "granite": ("Granite", {"embedding_multiplier": 3.0, "logits_scaling": 4.0, "residual_multiplier": 0.5,
                            "attention_multiplier": 0.3}, "zero3"),
    "granitemoe": ("GraniteMoe", {"embedding_multiplier": 3.0, "logits_scaling": 4.0, "residual_multiplier": 0.5,
                                  "attention_multiplier": 0.3, "num_local_experts": 4, "num_experts_per_tok": 2,
                                  **MOE_LOSS}, "zero3"),
    "cohere": ("Cohere", {"logit_scale": 0.25}, "cp"),
    "cohere2": ("Cohere2", {"num_hidden_layers": 4, "logit_scale": 0.25, "sliding_window": 5}, "zero3"),
    "phi": ("Phi", {"partial_rotary_factor": 0.5, "embd_pdrop": 0.0}, "zero3"),
    "ministral": ("Ministral", {"num_hidden_layers": 4, "head_dim": 8, "sliding_window": 5,
                                "layer_types": ["sliding_attention", "full_attention"] * 2}, "cp"),
    "deepseek_v3": ("DeepseekV3", {"num_hidden_layers": 3, "num_key_value_heads": 4, "n_routed_experts": 4,
                                   "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 16,
                                   "first_k_dense_replace": 1, "q_lora_rank": 16, "kv_lora_rank": 16,
                                   "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 6, "n_group": 1,
                                   "topk_group": 1, "pad_token_id": 0}, "ep"),
    "nemotron": ("Nemotron", {"head_dim": 8}, "zero3"),  # LayerNorm1P, partial rotary
    "stablelm": ("StableLm", {"use_qkv_bias": True, "qk_layernorm": True}, "cp"),
    "persimmon": ("Persimmon", {}, "zero3"),  # its final norm named final_layernorm
    "minimax_m2": ("MiniMaxM2", {"head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2, **MOE_LOSS},
                   "zero3"),  # Mixtral's forwards without a window, its router loss per microbatch
    "hy_v3": ("HYV3", {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "num_shared_experts": 1,
                       "moe_intermediate_size": 16, "mlp_layer_types": ["dense", "sparse"]}, "cp"),
    "minicpm3": ("MiniCPM3", {"num_key_value_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 4,
                              "qk_rope_head_dim": 4, "v_head_dim": 8, "dim_model_base": 8}, "zero3"),  # head input / 4
    "hyperclovax": ("HyperCLOVAX", {"embedding_multiplier": 3.0, "logits_scaling": 0.25}, "cp"),
    "nanochat": ("NanoChat", {"final_logit_softcapping": 0.5}, "zero3"),  # its final norm before the layers too
    "gpt_neox": ("GPTNeoX", {"hidden_dropout": 0.0, "attention_bias": True}, "cp"),  # Pythia's names
    "cwm": ("Cwm", {"head_dim": 8, "sliding_window": 5, "layer_types": ["full_attention", "sliding_attention"]},
            "cp"),  # Ministral's forward, Llama 3's rope scaling
    "cohere2_moe": ("Cohere2Moe", {"head_dim": 8, "logit_scale": 0.25, "sliding_window": 5, "num_experts": 4,
                                   "num_experts_per_tok": 2, "layer_types": ["sliding_attention", "full_attention"],
                                   "mlp_layer_types": ["sparse", "sparse"]}, "ep"),
    "exaone_moe": ("ExaoneMoe", {"head_dim": 8, "sliding_window": 5, "num_experts": 4, "num_experts_per_tok": 2,
                                 "moe_intermediate_size": 16, "first_k_dense_replace": 1,
                                 "layer_types": ["sliding_attention", "full_attention"],
                                 "mlp_layer_types": ["dense", "sparse"]}, "zero3"),
    "mellum": ("Mellum", {"head_dim": 8, "sliding_window": 5, "num_experts": 4, "num_local_experts": 4,
                          "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                          "layer_types": ["sliding_attention", "full_attention"],
                          "mlp_layer_types": ["sparse", "sparse"], **MOE_LOSS}, "cp"),  # rotary per layer type
    "afmoe": ("Afmoe", {"head_dim": 8, "sliding_window": 5, "num_experts": 4, "num_experts_per_tok": 2,
                        "moe_intermediate_size": 16, "num_dense_layers": 1, "num_shared_experts": 1,
                        "layer_types": ["sliding_attention", "full_attention"], "mup_enabled": True}, "ep"),
    "granite_swa": ("GraniteSWA", {**_GRANITE_SWA}, "cp"),  # rotary per layer base, some layers none
    "granitemoe_swa": ("GraniteMoeSWA", {**_GRANITE_SWA, "num_local_experts": 4, "num_experts_per_tok": 2,
                                         **MOE_LOSS}, "zero3"),
}
MESHES = {"zero3": {"pp": 2, "dp": 2, "dp_strategy": "zero3"}, "cp": {"pp": 2, "cp": 2},
          "ep": {"pp": 2, "dp": 2, "ep": 2}}


def builder(family):
    name, extra, _ = FAMILIES[family]
    config = getattr(transformers, name + "Config")
    model = getattr(transformers, name.removesuffix("Text") + "ForCausalLM")
    return lambda: model(config(**{**SMALL, **extra}))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_llama_shaped_family_on_pipeline_stages_matches_one_process(family):
    build = builder(family)
    assert build().config.model_type == family
    report = sw.check(build, padded, strategy=MESHES[FAMILIES[family][2]], world_size=4, steps=2)
    assert report.ok, str(report)


def test_starcoder2s_two_layer_mlp_is_split_by_the_llama_plan_on_pipeline_stages():
    """c_fc colwise, c_proj rowwise (with their biases), beside the attention's heads: tp2 x pp2 with padded rows."""
    report = sw.check(builder("starcoder2"), padded, strategy={"tp": 2, "pp": 2}, world_size=4, steps=2)
    assert report.ok, str(report)


def test_stablelm_takes_the_llama_plan_by_default_on_pipeline_stages():
    """StableLM ships no tensor-parallel plan of its own (refused before: "no built-in tensor-parallel plan"); its
    modules are Llama's, with q/k/v biases: tp2 x pp2 with padded rows. Its per-head q/k LayerNorms
    (``qk_layernorm=True``, a ModuleList of one LayerNorm per head) are refused by name."""
    config = transformers.StableLmConfig(**{**SMALL, "use_qkv_bias": True})
    report = sw.check(lambda: transformers.StableLmForCausalLM(config), padded, strategy={"tp": 2, "pp": 2},
                      world_size=4, steps=2)
    assert report.ok, str(report)
    assert "tp" in report.strategy
    with pytest.raises(ValueError, match=r"q_layernorm \(StableLmLayerNormPerHead\) has parameters and runs on the "
                                         r"heads"):
        sw.check(builder("stablelm"), padded, strategy={"tp": 2}, world_size=2, steps=1)


@pytest.mark.parametrize("family", ["starcoder2", "phi", "gpt_neox"])
def test_the_embedding_dropout_is_the_first_stages(family):
    torch.manual_seed(0)
    model = builder(family)()
    if family == "phi":
        model.model.embed_dropout.p = 0.5
    elif family == "gpt_neox":
        model.gpt_neox.emb_dropout.p = 0.5
    else:
        model.model.embedding_dropout = 0.5
    embed = model.get_input_embeddings()
    first = hf_stages.llama_pipeline_layers(model)[0]
    ids = torch.randint(0, 64, (2, 16))
    dropped = first(ids)
    assert 0.3 < float((dropped == 0).float().mean()) < 0.7  # about half of the embeddings dropped, in training
    torch.testing.assert_close(dropped[dropped != 0], 2 * embed(ids)[dropped != 0])
    first.eval()
    torch.testing.assert_close(first(ids), embed(ids))


#: Families transformers generates from listed ones: their forwards are a listed family's byte code
#: (hf_families.pipeline_kinds), their layers their own. (the listed families whose base-model and causal-LM forwards
#: they run, their config's extras, the mesh)
GENERATED = {
    "arcee": ("Arcee", ("llama", "llama"), {}, "zero3"),  # Llama's forwards, a ReLU-squared MLP
    "glm4": ("Glm4", ("llama", "llama"), {"head_dim": 8, "pad_token_id": 0}, "cp"),  # norms after attention, MLP
    "ernie4_5_moe": ("Ernie4_5_Moe", ("olmoe", "mixtral"), {"moe_num_experts": 4, "moe_k": 2, "moe_layer_start_index": 1,
                                                             "moe_intermediate_size": 16, **MOE_LOSS}, "zero3"),
    "vaultgemma": ("VaultGemma", ("gemma2", "gemma2"), {"head_dim": 8, "final_logit_softcapping": 0.5,
                                                        "sliding_window": 5}, "cp"),  # Gemma 2's soft cap
    "granitemoeshared": ("GraniteMoeShared", ("granitemoe", "granitemoe"), {
        "embedding_multiplier": 3.0, "logits_scaling": 4.0, "num_local_experts": 4, "num_experts_per_tok": 2,
        "shared_intermediate_size": 16, **MOE_LOSS}, "zero3"),  # Granite's multiplier and logit scale
    # Mellum's base forward, whose mask functions are lambdas (compared by their code, not where they were compiled)
    "laguna": ("Laguna", ("mellum", "mixtral"), {
        "head_dim": 8, "sliding_window": 5, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16, "layer_types": ["sliding_attention", "full_attention"],
        "num_attention_heads_per_layer": [4, 4], "mlp_layer_types": ["dense", "sparse"], **MOE_LOSS}, "cp"),
    "mimo_v2_flash": ("MiMoV2Flash", ("mellum", "deepseek_v3"), {
        "head_dim": 8, "v_head_dim": 8, "sliding_window": 5, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "layer_types": ["sliding_attention", "full_attention"],
        "mlp_layer_types": ["dense", "sparse"]}, "ep"),
}


@pytest.mark.parametrize("family", list(GENERATED))
def test_a_family_generated_from_a_listed_one_on_pipeline_stages_matches_one_process(family):
    """Refused before ("not a known HuggingFace decoder"); the extras are those of the family whose forward it runs
    (VaultGemma's soft cap is Gemma 2's, GraniteMoeShared's multiplier and scale Granite-MoE's)."""
    from shardwise.models.hf_families import pipeline_kinds

    name, kinds, extra, mesh = GENERATED[family]
    config = getattr(transformers, name + "Config")(**{**SMALL, **extra})
    build = lambda: getattr(transformers, name + "ForCausalLM")(config)  # noqa: E731
    assert build().config.model_type == family and pipeline_kinds(build()) == kinds
    report = sw.check(build, padded, strategy=MESHES[mesh], world_size=4, steps=2)
    assert report.ok, str(report)


def test_a_family_not_known_to_be_llama_shaped_is_refused_by_name():
    model = transformers.JetMoeForCausalLM(transformers.JetMoeConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_local_experts=4,
        num_experts_per_tok=2, kv_channels=8, intermediate_size=32))

    def body(comm):
        with pytest.raises(ValueError, match="is not a known HuggingFace decoder") as raised:
            sw.parallelize(model, sw.Mesh(comm, pp=2))
        return str(raised.value)

    for error in sw.launch(body, 2):
        assert type(model).__name__ in error


FALCON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, ffn_hidden_size=64,
              max_position_embeddings=64, attn_implementation="eager", hidden_dropout=0.0, attention_dropout=0.0)


@pytest.mark.parametrize("variant", [
    {"new_decoder_architecture": True, "num_kv_heads": 2},  # Falcon-40B / -180B: grouped kv, two norms per layer
    {"multi_query": True, "parallel_attn": True},  # Falcon-7B: one kv head, attention beside the MLP
    {"multi_query": False, "parallel_attn": False, "bias": True},  # sequential residual, biases
], ids=["new_architecture", "multi_query", "sequential"])
def test_falcon_on_pipeline_stages_matches_one_process(variant):
    """Falcon (refused before): its base model ``transformer`` with ``word_embeddings``, ``h`` and ``ln_f`` and a
    layer that takes ``alibi`` (None for rotary Falcons) beside Llama's arguments; pp2 x dp2 ZeRO-3, padded rows."""
    config = transformers.FalconConfig(**FALCON, **variant)
    build = lambda: transformers.FalconForCausalLM(config)  # noqa: E731
    report = sw.check(build, padded, strategy=MESHES["zero3"], world_size=4, steps=2)
    assert report.ok, str(report)


def test_an_alibi_falcon_is_refused_by_name():
    model = transformers.FalconForCausalLM(transformers.FalconConfig(**FALCON, alibi=True))
    with pytest.raises(ValueError, match=r"FalconForCausalLM with alibi=True \(ALiBi biases built from the padding"):
        hf_stages.llama_pipeline_layers(model)


#: Families listed whose layers are of kinds beyond Llama's, built from `make soak`'s tiny configs (hf_sweep.py):
#: DeepSeek-V3.2 (indexed attention: a lightning indexer picks each query's keys under the causal mask), MiniMax
#: (lightning linear-attention layers beside full ones; Mixtral's router loss), Kimi-Linear (linear attention beside
#: latent attention without positions: no rotary module), LongCat-Flash (two attention and MLP sublayers per layer,
#: zero-computation experts). (class, mesh); DeepSeek-V3.2's indexer gets no gradient (as in one process), which DDP
#: would refuse without find_unused_parameters: ZeRO-3 there.
SWEPT = {
    "deepseek_v32": ("DeepseekV32ForCausalLM", {**MESHES["ep"], "dp_strategy": "zero3"}),
    "minimax": ("MiniMaxForCausalLM", MESHES["ep"]),
    "kimi_linear": ("KimiLinearForCausalLM", MESHES["zero3"]),
    "longcat_flash": ("LongcatFlashForCausalLM", MESHES["zero3"]),
}


@pytest.mark.parametrize("family", list(SWEPT))
def test_families_with_other_layer_kinds_on_pipeline_stages_match_one_process(family):
    """Refused before ("not a known HuggingFace decoder"); left-padded rows (SDPA), two AdamW steps (Kimi-Linear
    one)."""
    hf_sweep = pytest.importorskip("hf_sweep")
    name, mesh = SWEPT[family]
    make, why = hf_sweep.builder(family, name, "left_padded_lm")
    assert make is not None, why

    def build():
        model = make()
        if family == "minimax":  # its router loss, carried through the stages per microbatch
            model.config.output_router_logits, model.config.router_aux_loss_coef = True, 0.05
        return model

    steps = 1 if family == "kimi_linear" else 2  # its linear attention's reference kernel is slow in float64
    report = sw.check(build, hf_sweep.left_padded_batch, strategy={**mesh, "n_microbatches": 2},
                      world_size=4, steps=steps)
    assert report.ok, str(report)
