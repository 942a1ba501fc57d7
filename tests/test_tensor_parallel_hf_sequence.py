"""Sequence parallelism for HuggingFace decoders under plan "llama" (tensor_parallel/hf_sequence.py): each family
through `sw.check` against one process (AdamW with weight decay, a binding clip), where the shards run, and what is
refused by name (mixture-of-experts blocks: tests/test_sequence_parallel_moe.py). A latent attention (DeepSeek-V3's,
MiniCPM3's) takes the whole sequence with its gradient split back (refused before)."""

from __future__ import annotations

import pytest
import torch
from hf_decoders import gemma, llama, qwen3
from test_parallelize_hf_families import SMALL, builder

import shardwise as sw
from shardwise import tensor_parallel as tp

transformers = pytest.importorskip("transformers")

SP = {"tp": 2, "tp_plan": "llama", "sequence_parallel": True}


def batch(step):
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


def deepseek_v2_lite():
    """No query compression (q_lora_rank=None): its q_proj takes the layer's input inside the latent attention."""
    torch.manual_seed(0)
    return transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(
        **{**SMALL, "num_key_value_heads": 4}, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        first_k_dense_replace=1, n_shared_experts=1, n_group=1, topk_group=1))


FAMILIES = {
    "llama": llama,
    "qwen3": qwen3,  # per-head q_norm / k_norm ("heads") inside the gathered attention
    "gemma": gemma,  # its embedding scales its output: kept whole, and the head tied to it
    "olmo": builder("olmo"),  # norms without parameters
    "phi3": builder("phi3"),  # fused qkv_proj and gate_up_proj
    "cohere": builder("cohere"),  # attention and MLP in parallel on one norm's output
    "deepseek_v3": builder("deepseek_v3"),  # latent attention (whole input, split up projections) and MoE blocks
    "minicpm3": builder("minicpm3"),  # latent attention, dense MLPs
    "deepseek_v2_lite": deepseek_v2_lite,
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_under_tensor_and_sequence_parallel_matches_one_process(family):
    report = sw.check(FAMILIES[family], batch, strategy=SP, world_size=2, steps=2)
    assert report.ok, str(report)


@pytest.mark.parametrize("axis", [{"dp": 2, "dp_strategy": "zero3"}, {"cp": 2}, {"pp": 2}, {"pp": 2, "cp": 2}],
                         ids=["dp2-zero3", "cp2-ring", "pp2", "pp2-cp2"])
def test_with_another_axis(axis):
    """With pp (sw.parallelize's stages) every decoder stage after the first receives shards and builds the mask and
    positions of the whole sequence (hf_stages.LlamaDecoderStage.sequence_split)."""
    world = 2 * axis.get("dp", 1) * axis.get("cp", 1) * axis.get("pp", 1)
    report = sw.check(llama, batch, strategy={**SP, **axis}, world_size=world, steps=2)
    assert report.ok, str(report)


def test_padded_rows_on_pipeline_stages():
    from test_check_pipelines import padded

    report = sw.check(llama, padded, strategy={**SP, "pp": 2}, world_size=4, steps=2)
    assert report.ok, str(report)


def test_the_norms_run_on_shards_and_the_attention_and_model_output_on_the_whole_sequence():
    base = llama()
    ids = batch(0)["input_ids"]

    def body(comm, model):
        import copy

        model = tp.parallelize(copy.deepcopy(model), comm, "llama", sequence_parallel=True)
        seen = {}

        def record(name):
            def hook(module, args, out):
                seen[name] = (args[0].shape[1], out.shape[1])  # (tokens in, tokens out)

            return hook

        for name in ("model.layers.0.input_layernorm", "model.layers.1.post_attention_layernorm",
                     "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.up_proj", "model.norm"):
            model.get_submodule(name).register_forward_hook(record(name))
        out = model.model(input_ids=ids).last_hidden_state
        return seen, tuple(out.shape)

    for seen, out in sw.launch(body, 2, base):
        assert seen["model.layers.0.input_layernorm"] == (8, 8)  # 16 tokens, this rank's 8
        assert seen["model.layers.1.post_attention_layernorm"] == (8, 8)
        assert seen["model.layers.0.self_attn.q_proj"][0] == 16  # gathered as the attention entered
        assert seen["model.layers.1.mlp.up_proj"][0] == 16
        assert seen["model.norm"] == (8, 16)  # its output gathered
        assert out == (4, 16, 32)


def _refusal(build):
    def body(comm):
        with pytest.raises(ValueError) as raised:
            sw.parallelize(build(), sw.Mesh(comm, tp=2), tp_plan="llama", sequence_parallel=True)
        return str(raised.value)

    return sw.launch(body, 2)[0]


@pytest.mark.parametrize("axis", [{}, {"pp": 2}], ids=["tp2", "tp2-pp2"])
def test_a_gated_deltanet_runs_on_the_whole_sequence(axis):
    """Qwen3.5's linear-attention layers (plan "llama" keeps the Gated DeltaNet whole) run on the whole sequence, their
    recurrence and the padding mask as in one process; left-padded rows (refused before)."""
    from test_labels_at_padding import left_padded
    from test_pipeline_linear_attention import qwen3_5

    report = sw.check(qwen3_5, left_padded, strategy={**SP, **axis}, world_size=2 * axis.get("pp", 1), steps=2)
    assert report.ok, str(report)


def falcon_h1():
    """Attention and a Mamba-2 mixer side by side in every layer, with muP multipliers."""
    torch.manual_seed(0)
    return transformers.FalconH1ForCausalLM(transformers.FalconH1Config(
        **{**SMALL, "head_dim": 8}, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8,
        mamba_chunk_size=8))


@pytest.mark.parametrize("strategy", [SP, "tp"], ids=["tp2-sp", "tp2-default-plan"])
def test_a_mamba_mixer_runs_on_the_whole_sequence(strategy):
    """Falcon-H1's Mamba-2 mixer (plan "llama" keeps it whole) runs on the whole sequence under sequence parallel,
    left-padded rows; plan "llama" is Falcon-H1's default (no built-in plan before)."""
    from test_labels_at_padding import left_padded

    report = sw.check(falcon_h1, left_padded, strategy=strategy, world_size=2, steps=2)
    assert report.ok, str(report)


class _Wrapped(torch.nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.inner = mlp

    def forward(self, hidden_states):
        return self.inner(hidden_states)


def test_what_cannot_run_on_shards_is_refused_by_name():
    def nested():  # a split projection below another module of the layer: what gathers its input is unknown
        model = llama()
        model.model.layers[0].mlp = _Wrapped(model.model.layers[0].mlp)
        return model

    assert "'model.layers.0.mlp.inner.gate_proj' is split and takes something else" in _refusal(nested)
    starcoder2 = transformers.Starcoder2ForCausalLM
    dropping = lambda: starcoder2(transformers.Starcoder2Config(**{**SMALL, "embedding_dropout": 0.1}))  # noqa: E731
    assert "'model.embedding_dropout' drops out" in _refusal(dropping)
