"""Expert parallel for Llama 4 (text): its experts module runs every expert on every token, the input scaled by the
router's score (the sigmoid of the token's top-k logits, 0 elsewhere), inside Llama 4's MoE block beside a shared
expert (experts/hf_kinds.py, the "llama4" template; hf_experts.Llama4MoeParallel). Refused by name before. `sw.check`
against one process, left-padded rows, AdamW: ep2 under DDP and under ZeRO-3, ep2 x dp4 (edp 2), and pp2 x ep2
with Llama 4's chunked attention on the pipeline stages. A block whose forward is not Llama 4's is refused, naming
it."""

from __future__ import annotations

import pytest
from test_labels_at_padding import left_padded
from test_pipeline_chunked_attention import llama4

import shardwise as sw

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("strategy,world", [
    ({"ep": 2}, 2),
    ({"ep": 2, "dp_strategy": "zero3"}, 2),
    ({"dp": 4, "ep": 2}, 4),
    ({"pp": 2, "ep": 2, "n_microbatches": 2}, 4),
], ids=["ep2", "ep2-zero3", "dp4-ep2", "pp2xep2"])
def test_llama4_experts_split_over_ep_match_one_process(strategy, world):
    report = sw.check(llama4, left_padded, strategy=strategy, world_size=world, steps=2)
    assert report.ok, str(report)
    assert "ep" in report.strategy


def test_a_llama4_block_with_a_forward_of_its_own_is_refused_naming_it():
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    class Reweighted(Llama4TextMoe):
        def forward(self, hidden_states):
            out, logits = super().forward(hidden_states)
            return 2 * out, logits

    def build():
        model = llama4()
        for layer in model.model.layers:
            layer.feed_forward.__class__ = Reweighted
        return model

    with pytest.raises(ValueError, match=r"Llama4TextExperts, a mixture-of-experts layer expert_parallel does not "
                                         r"support: its MoE block's forward is not Llama4TextMoe's"):
        sw.check(build, left_padded, strategy={"ep": 2}, world_size=2, steps=1)
