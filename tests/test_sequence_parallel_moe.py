"""Sequence parallelism with HuggingFace mixture-of-experts decoders under plan "llama"
(tensor_parallel/hf_sequence.py): the norms and residual stream run on sequence shards, and each MoE block on the
whole sequence (its input gathered, its output cut back to the shard), so the router sees every token and the
load-balancing loss is one process's. Refused by name before. `sw.check` against one process (AdamW with weight
decay, a binding clip) with Mixtral's, Qwen2-MoE's (a split shared expert beside the routed ones), GPT-OSS's and
Llama 4's (output flattened to tokens x hidden) and DeepSeek-V3's blocks and their router losses on; with pipeline
stages (the router statistics carried between stages) and context parallel, with context and expert parallel under
ZeRO-3, and DeepSeek-V3 on pp2 x dp2 x ep2, on left-padded rows; HuggingFace's own forward (tp.parallelize
without sw.parallelize) computing its router loss from whole logits; and what still cannot run on shards, refused."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_decoders import gpt_oss, llama, mixtral, qwen2_moe
from test_labels_at_padding import left_padded
from test_parallelize_hf_families import builder
from test_pipeline_chunked_attention import llama4
from test_tensor_parallel_hf_sequence import SP, _refusal, batch

import shardwise as sw
from shardwise import tensor_parallel as tp

transformers = pytest.importorskip("transformers")

FAMILIES = {"mixtral": mixtral, "qwen2_moe": qwen2_moe, "gpt_oss": gpt_oss, "llama4": llama4,
            "deepseek_v3": builder("deepseek_v3")}  # its latent attention takes the whole sequence too


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_moe_family_under_tensor_and_sequence_parallel_matches_one_process(family):
    report = sw.check(FAMILIES[family], batch, strategy=SP, world_size=2, steps=2)
    assert report.ok, str(report)


@pytest.mark.parametrize("family,axis,batches", [
    ("qwen2_moe", {"pp": 2, "cp": 2}, left_padded),
    ("mixtral", {"cp": 2, "dp": 2, "ep": 2, "dp_strategy": "zero3"}, left_padded),
    ("deepseek_v3", {"pp": 2, "dp": 2, "ep": 2, "n_microbatches": 2}, left_padded),
], ids=["qwen2_moe-pp2-cp2-left-padded", "mixtral-cp2-dp2-ep2-zero3-left-padded", "deepseek_v3-pp2-dp2-ep2"])
def test_with_other_axes(family, axis, batches):
    """Under pp the stages carry the router statistics: the MoE block's routers see this rank's whole (cp) sequence
    while the layers pass shards (hf_router_loss._token_weights weighs its tokens by the padding)."""
    world = 2 * axis.get("dp", 1) * axis.get("cp", 1) * axis.get("pp", 1)
    report = sw.check(FAMILIES[family], batches, strategy={**SP, **axis}, world_size=world, steps=2)
    assert report.ok, str(report)


def test_huggingface_forward_computes_its_router_loss_over_the_whole_sequence():
    """tp.parallelize alone: HuggingFace's own forward records the router logits and adds the load-balancing loss;
    every rank's loss, aux loss and (replicated) router gradient are one process's."""
    torch.manual_seed(0)
    base = mixtral().double()
    tokens = batch(0)
    mask = torch.ones_like(tokens["input_ids"])
    mask[1, 11:] = 0
    inputs = {**tokens, "attention_mask": mask, "labels": tokens["labels"].masked_fill(mask == 0, -100)}
    alone = copy.deepcopy(base)
    out = alone(**inputs)
    out.loss.backward()
    want = (out.loss.item(), out.aux_loss.item(), alone.model.layers[1].mlp.gate.weight.grad)
    seen = {}

    def body(comm, model):
        model = tp.parallelize(copy.deepcopy(model), comm, "llama", sequence_parallel=True)

        def record(module, args, out):  # after the block's own hooks: the input gathered, the output cut
            seen[comm.rank] = (args[0].shape[1], out.shape[1])

        model.get_submodule("model.layers.0.mlp").register_forward_hook(record)
        got = model(**inputs)
        got.loss.backward()
        return got.loss.item(), got.aux_loss.item(), model.model.layers[1].mlp.gate.weight.grad

    for rank, (loss, aux, grad) in enumerate(sw.launch(body, 2, base)):
        assert seen[rank] == (16, 8)  # the block saw the 16 tokens, and passed on this rank's 8
        assert loss == pytest.approx(want[0], abs=1e-12) and aux == pytest.approx(want[1], abs=1e-12)
        torch.testing.assert_close(grad, want[2], rtol=0, atol=1e-12)


def test_a_module_with_parameters_that_is_neither_a_norm_nor_a_moe_block_is_refused():
    def adapted():
        model = llama()
        model.model.layers[0].adapter = torch.nn.Linear(32, 32)  # runs nowhere; holds parameters in the layer
        return model

    assert "'model.layers.0.adapter' (Linear) holds parameters" in _refusal(adapted)


def test_dropout_inside_a_moe_block_is_refused_by_name():
    """The block runs on the whole sequence on every rank, while sequence parallel draws each rank's own masks."""
    def dropping():
        model = mixtral()
        model.model.layers[1].mlp.experts.dropout = 0.1  # as a block that drops out functionally at this rate
        return model

    assert "'model.layers.1.mlp.experts' drops out inside 'model.layers.1.mlp' (MixtralSparseMoeBlock)" in \
        _refusal(dropping)
