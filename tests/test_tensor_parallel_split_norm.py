"""Norms over the whole width of a split projection (OLMo 2 / 3 and OLMoE's q_norm / k_norm) under tensor parallel.

Before, the "llama" plan refused these models by name. Now the norm is split with its projection and its mean square
summed over the group (tensor_parallel/split_norm.py): each family is checked against one process through `sw.check`
(tp=2 alone, and tp with pp / dp ZeRO-3 / cp over four ranks), the split norm's form is checked bitwise against the
model's own norm, and a norm of another formula is refused by name.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from parity import ATOL, RTOL
from test_check_pipelines import padded
from test_parallelize_hf_families import builder
from test_tensor_parallel_plans import RMSNorm
from torch import nn

import shardwise as sw
from shardwise import tensor_parallel as tp
from shardwise.sharded_tensor import local
from shardwise.tensor_parallel.split_norm import SplitRMSNorm

transformers = pytest.importorskip("transformers")

VOCAB, D, HEADS, KV_HEADS, FF, T = 64, 32, 4, 2, 48, 16


def _config(kind: str):
    extra = {"num_experts": 4, "num_experts_per_tok": 2} if kind == "Olmoe" else {}
    return getattr(transformers, f"{kind}Config")(
        vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        intermediate_size=FF, max_position_embeddings=T, pad_token_id=0, **extra)


def _batch(step):
    ids = torch.randint(0, VOCAB, (4, T), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("kind", ["Olmo2", "Olmo3", "Olmoe"])
def test_a_family_with_whole_width_qk_norms_trains_like_one_process_under_the_llama_plan(kind):
    config = _config(kind)
    build = lambda: getattr(transformers, f"{kind}ForCausalLM")(config)  # noqa: E731
    report = sw.check(build, _batch, strategy="tp:llama", world_size=2, steps=2, rtol=RTOL, atol=ATOL,
                      optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-5))
    assert report.ok, str(report)


@pytest.mark.parametrize("family, mesh", [
    ("olmo2", {"tp": 2, "pp": 2}),
    ("olmoe", {"tp": 2, "dp": 2, "dp_strategy": "zero3"}),  # with its router loss
    ("olmo3", {"tp": 2, "cp": 2}),
], ids=["olmo2-tp2xpp2", "olmoe-tp2xdp2-zero3", "olmo3-tp2xcp2"])
def test_split_norms_compose_with_the_other_axes_on_padded_rows(family, mesh):
    report = sw.check(builder(family), padded, strategy=mesh, world_size=4, steps=2)
    assert report.ok, str(report)


@pytest.mark.parametrize("kind", ["Olmo2", "Olmoe"])
def test_the_split_norm_computes_the_models_own_form_to_the_bit(kind):
    """OLMo 2 casts after the weight, OLMoE (like Llama) before it: in bfloat16 the two differ, and the split norm
    (on a group of one, where the mean is the model's own) gives the norm's bits with a trained (random) weight."""
    module = importlib.import_module(f"transformers.models.{kind.lower()}.modeling_{kind.lower()}")
    norm = getattr(module, f"{kind}RMSNorm")(D).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(D, generator=gen) * 3 - 1)
    split = SplitRMSNorm.from_dense(norm, sw.init(), "q_norm")
    x = torch.randn(3, 5, D, generator=gen).to(torch.bfloat16)
    assert torch.equal(split(x), norm(x))
    assert split.form == {"Olmo2": "(weight * h).to(dtype)", "Olmoe": "weight * h.to(dtype)"}[kind]


def test_a_split_norm_keeps_its_ranks_features_and_gathers_whole():
    dense = transformers.Olmo2ForCausalLM(_config("Olmo2"))  # built once: thread ranks share torch's generator
    with torch.no_grad():
        dense.model.layers[0].self_attn.q_norm.weight.copy_(torch.arange(D, dtype=torch.float32))
    whole = dense.model.layers[0].self_attn.q_norm.weight.detach().clone()

    def body(comm):
        model = tp.parallelize(copy.deepcopy(dense), comm, "llama")
        q_norm = model.model.layers[0].self_attn.q_norm
        return (type(q_norm).__name__, tuple(q_norm.weight.shape), local(q_norm.weight).tolist(),
                torch.equal(tp.full_state_dict(model)["model.layers.0.self_attn.q_norm.weight"], whole))

    half = D // 2
    assert sw.launch(body, 2) == [("SplitRMSNorm", (D,), [float(i) for i in range(half)], True),
                                  ("SplitRMSNorm", (D,), [float(i) for i in range(half, D)], True)]


class _OnePlusWeightRMSNorm(nn.Module):  # Gemma's form
    def __init__(self, d):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.zeros(d)), 1e-6

    def forward(self, x):
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())).type_as(x)


@pytest.mark.parametrize("norm, match", [
    (RMSNorm, r"q_norm \(RMSNorm\) has parameters \['weight'\] and epsilon None"),  # its epsilon is a literal
    (_OnePlusWeightRMSNorm, r"q_norm \(_OnePlusWeightRMSNorm\) normalizes the whole width .* none of the RMSNorm "
                            r"forms"),
], ids=["no_epsilon", "one_plus_weight"])
def test_a_whole_width_norm_of_another_formula_is_refused_by_name(norm, match):
    model = transformers.Olmo2ForCausalLM(_config("Olmo2"))
    model.model.layers[1].self_attn.q_norm = norm(D)
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn." + match):
        tp.parallelize(model, sw.init(), "llama")
