"""sw.check with expert parallel in the strategy ({"ep": 2, ...}): a HuggingFace MoE model (Qwen3-MoE, its
load-balancing loss on) checked against one process, clean, and with a planted error in the experts' computation,
which the check must find; an ep that does not divide the data-parallel ranks is refused by name."""

from __future__ import annotations

import pytest
import torch

from shardwise.check import check
from shardwise.experts import hf_experts

transformers = pytest.importorskip("transformers")


def qwen3_moe():
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=32, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, output_router_logits=True, router_aux_loss_coef=0.05, attn_implementation="eager"))


def batch(step):
    ids = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


def test_experts_over_ep_inside_zero3_are_clean():
    report = check(qwen3_moe, batch, strategy={"ep": 2, "dp_strategy": "zero3"}, world_size=4, steps=2)
    text = str(report)
    assert report.ok, text
    assert "experts over ep=2 x zero3 over dp=4 on 4 thread ranks" in text
    assert "model.layers.0.mlp.experts.gate_up_proj" in [r.name for r in report.rows]


def test_a_planted_error_in_the_experts_is_found(monkeypatch):
    right = hf_experts.FusedExpertsParallel._compute
    monkeypatch.setattr(hf_experts.FusedExpertsParallel, "_compute",
                        lambda self, x, counts: right(self, x, counts) * 1.001)
    report = check(qwen3_moe, batch, strategy={"ep": 2, "dp_strategy": "ddp"}, world_size=2, steps=2)
    assert not report.ok
    assert report.first_mismatch.step == 0, str(report)


def test_ep_must_divide_the_data_parallel_ranks():
    with pytest.raises(ValueError, match=r"ep=3 must divide the 4 data-parallel ranks"):
        check(qwen3_moe, batch, strategy={"ep": 3, "dp_strategy": "ddp"}, world_size=4)


def test_under_context_parallel_the_load_balancing_loss_is_in_the_loss():
    """Under cp the check computes each rank's loss from its chunks' logits; a HuggingFace MoE adds
    router_aux_loss_coef x aux_loss to its loss, which the check left out (a false DIFF at step 0: loss 4.1915 against
    4.2916 in one process). The batch's non-tensor entries (use_cache=False) pass as they are (they raised
    "'bool' object is not iterable")."""
    report = check(qwen3_moe, lambda step: {**batch(step), "use_cache": False}, strategy={"cp": 2}, world_size=2,
                   steps=2)
    assert report.ok, str(report)
    with torch.no_grad():
        assert 0.05 * float(qwen3_moe()(**batch(0)).aux_loss) > 0.01  # far above the check's tolerance
