"""A MoE model's load-balancing loss read by the script (``out.aux_loss``), not only the one the model adds to its
loss: under data parallelism it is the global batch's, or the model is refused.

A script that computes its own cross-entropy from the logits (chunked, z-loss, a schedule of its own) adds
``coef x out.aux_loss`` itself, often with the config's ``router_aux_loss_coef`` set to 0 so the model adds nothing.
The load-balancing loss is a product of batch means (experts/hf_aux.py): each rank's own is not one process's.
Before, a Mixtral with coefficient 0 and JetMoE (whose coefficient is named ``aux_loss_coef``) returned each rank's
own ``aux_loss`` under DDP / ZeRO / FSDP / expert parallelism, silently; now Mixtral's is the global batch's and
JetMoE's, which hf_kinds cannot read as Mixtral's, is refused naming its coefficient. Checked with `sw.check`: AdamW
with weight decay, a binding clip, two steps against one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

import shardwise as sw  # noqa: E402


def _mixtral_without_coefficient():
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
        router_aux_loss_coef=0.0, tie_word_embeddings=False, attn_implementation="eager",
        experts_implementation="eager")).double()


def _jetmoe():
    from transformers import JetMoeConfig, JetMoeForCausalLM

    return JetMoeForCausalLM(JetMoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_key_value_heads=2,
        kv_channels=8, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
        attn_implementation="eager")).double()


def _batch(step: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(step))}


def _own_loss(model, batch):
    """The script's loss: next-token cross-entropy from the logits plus 0.05 x the model's load-balancing loss."""
    out = model(input_ids=batch["input_ids"])
    logits = out.logits[:, :-1]
    cross_entropy = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["input_ids"][:, 1:].reshape(-1))
    return cross_entropy + 0.05 * out.aux_loss


@pytest.mark.parametrize("strategy", ["ddp", "zero3", {"ep": 2}])
def test_the_aux_loss_a_script_adds_is_the_global_batchs(strategy):
    report = sw.check(_mixtral_without_coefficient, _batch, strategy=strategy, world_size=2, steps=2,
                      loss_fn=_own_loss)
    assert report.ok, str(report)


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_a_load_balancing_loss_under_a_coefficient_of_another_name_is_refused(strategy):
    with pytest.raises(ValueError, match=r"JetMoeForCausalLM has aux_loss_coef=0\.01 with output_router_logits on; "
                                         r"its load-balancing loss .* set output_router_logits=False"):
        sw.check(_jetmoe, _batch, strategy=strategy, world_size=2, steps=2, loss_fn=_own_loss)
