"""Phi-3's fused qkv_proj under tensor parallel (tensor_parallel/fused_qkv.py).

Before, the "llama" plan refused Phi-3 by name. Now its [q | k | v] projection is split block by block (uneven blocks
under grouped-query attention) and its attention reads this rank's head counts from a view of the config: checked
against one process through `sw.check` (tp=2, with a sliding window and partial rotary; with tp x pp and tp x dp
ZeRO-3 on padded rows), the model's config left as it was, and another attention with a fused qkv_proj refused.
"""

from __future__ import annotations

import copy

import pytest
import torch
from parity import ATOL, RTOL
from test_check_pipelines import padded
from test_parallelize_hf_families import builder
from torch import nn

import shardwise as sw
from shardwise import tensor_parallel as tp
from shardwise.sharded_tensor import local
from shardwise.tensor_parallel.plans import llama_plan

transformers = pytest.importorskip("transformers")

VOCAB, D, FF, T = 64, 32, 48, 16


def _phi3(heads: int, kv_heads: int):
    return transformers.Phi3Config(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2, num_attention_heads=heads,
                                   num_key_value_heads=kv_heads, intermediate_size=FF, max_position_embeddings=T,
                                   pad_token_id=0, sliding_window=5, partial_rotary_factor=0.5)


def _batch(step):
    ids = torch.randint(0, VOCAB, (4, T), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (8, 2)], ids=["mha", "gqa2", "gqa4"])
def test_phi3_trains_like_one_process_under_the_llama_plan(heads, kv_heads):
    config = _phi3(heads, kv_heads)
    report = sw.check(lambda: transformers.Phi3ForCausalLM(config), _batch, strategy="tp:llama", world_size=2,
                      steps=2, rtol=RTOL, atol=ATOL,
                      optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-5))
    assert report.ok, str(report)


@pytest.mark.parametrize("mesh", [{"tp": 2, "pp": 2}, {"tp": 2, "dp": 2, "dp_strategy": "zero3"}],
                         ids=["tp2xpp2", "tp2xdp2-zero3"])
def test_phi3_with_the_other_axes_on_padded_rows(mesh):
    report = sw.check(builder("phi3"), padded, strategy=mesh, world_size=4, steps=2)
    assert report.ok, str(report)


def test_the_split_keeps_whole_heads_of_each_block_and_leaves_the_models_config_alone():
    dense = transformers.Phi3ForCausalLM(_phi3(8, 2))  # built once: thread ranks share torch's generator
    qkv = dense.model.layers[0].self_attn.qkv_proj.weight.detach().clone()  # (8 + 2 + 2) x 4 rows

    def body(comm):
        model = tp.parallelize(copy.deepcopy(dense), comm, "llama")
        attn = model.model.layers[0].self_attn
        rows = local(attn.qkv_proj.weight)
        q, k, v = qkv.split([32, 8, 8])
        mine = torch.cat([b.chunk(2)[comm.rank] for b in (q, k, v)])  # 4 query heads, 1 key head, 1 value head
        gathered = tp.full_state_dict(model)["model.layers.0.self_attn.qkv_proj.weight"]
        return (torch.equal(rows, mine), torch.equal(gathered, qkv), model.config.num_attention_heads,
                model.config.num_key_value_heads, attn.num_key_value_heads)

    assert sw.launch(body, 2) == [(True, True, 8, 2, 1)] * 2


def test_a_tp_size_that_does_not_divide_the_key_value_heads_is_refused():
    with pytest.raises(ValueError, match=r"tp size 4 does not divide the number of key/value heads of "
                                         r"model.layers.0.self_attn \(num_key_value_heads\)=2"):
        llama_plan(transformers.Phi3ForCausalLM(_phi3(8, 2)), 4)


class _OtherFusedAttention(nn.Module):
    """A fused qkv_proj the plan does not know: it might slice its output by global offsets."""

    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.qkv_proj, self.o_proj = attn.qkv_proj, attn.o_proj


def test_a_fused_qkv_projection_of_another_attention_is_refused_by_name():
    model = transformers.Phi3ForCausalLM(_phi3(4, 2))
    model.model.layers[1].self_attn = _OtherFusedAttention(model.model.layers[1].self_attn)
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.qkv_proj \(_OtherFusedAttention\) fuses q, k "
                                         r"and v in one Linear.* splits the fused qkv_proj of Phi3Attention"):
        tp.parallelize(model, sw.init(), "llama")


def test_a_plan_dict_splitting_phi3s_qkv_in_equal_blocks_is_refused():
    """Under grouped-query attention [q | k | v] is (32, 8, 8): three equal blocks of 16 would mix queries and keys."""
    model = transformers.Phi3ForCausalLM(_phi3(8, 2))

    def body(comm):
        with pytest.raises(ValueError, match=r"model.layers.0.self_attn.qkv_proj is split in blocks \(16, 16, 16\), "
                                             r"but its output is \[q \| k \| v\] = \(32, 8, 8\)"):
            tp.parallelize(copy.deepcopy(model), comm, {"qkv_proj": tp.Colwise(fused=3), "o_proj": "rowwise"})

    sw.launch(body, 2)
