"""Packed rows of a HuggingFace decoder whose forward builds its causal mask without the position ids (hf_packing.py).

transformers keeps packed documents apart (eager / SDPA attention) only in its mask functions, given position_ids.
GPT-OSS, AFMoE, Falcon and OPT build their masks without them, so with those attentions one process lets the documents
of a packed row attend to each other, while the pipeline stages and ring / Ulysses attention keep them apart, as
transformers does under flash attention (docs/context_parallel.md, "Packed sequences"). `sw.check` then differs at
the first loss; its report says why, naming the module. Families that pass the positions (Llama, Mistral through its
``mask_function``, Gemma 3 through a copy of its mask arguments) train packed rows like one process, with no note."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.hf_packing import mask_without_positions

transformers = pytest.importorskip("transformers")
hf_sweep = pytest.importorskip("hf_sweep")


def build(model_type, class_name):
    make, why = hf_sweep.builder(model_type, class_name)
    assert make is not None, why
    return make


def packed(step):
    """4 rows of 16 tokens, two documents each (positions restart at 6)."""
    ids = torch.randint(3, 96, (4, 16), generator=torch.Generator().manual_seed(step))
    labels = ids.clone()
    labels[:, [0, 6]] = -100
    positions = torch.cat([torch.arange(6), torch.arange(10)]).repeat(4, 1)
    return {"input_ids": ids, "position_ids": positions, "labels": labels, "use_cache": False}


@pytest.mark.parametrize("model_type,class_name,where", [
    ("gpt_oss", "GptOssForCausalLM", "model (GptOssModel)"),
    ("afmoe", "AfmoeForCausalLM", "model (AfmoeModel)"),
    ("falcon", "FalconForCausalLM", "transformer (FalconModel)"),
    ("opt", "OPTForCausalLM", "model.decoder (OPTDecoder)"),
    ("llama", "LlamaForCausalLM", None),
    ("mistral", "MistralForCausalLM", None),  # mask_function = create_causal_mask if ... else ...
    ("gemma3_text", "Gemma3ForCausalLM", None),  # sliding_mask_kwargs = mask_kwargs.copy()
    ("gpt2", "GPT2LMHeadModel", None),
])
def test_the_families_that_build_their_mask_without_positions_are_found(model_type, class_name, where):
    assert mask_without_positions(build(model_type, class_name)()) == where


def _forward(body, folder):
    """A module whose forward is `body` (source text, written to a file: the reader reads the source)."""
    import importlib.util

    path = folder / "decoder.py"
    path.write_text("create_causal_mask = create_sliding_window_causal_mask = None\n\n"
                    f"def forward(self, x, position_ids=None, attention_mask=None):\n{body}\n    return x\n")
    spec = importlib.util.spec_from_file_location(f"decoder_{abs(hash(body))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return type("Decoder", (nn.Module,), {"forward": module.forward})()


@pytest.mark.parametrize("body,ignores", [
    ("    create_causal_mask(attention_mask=attention_mask, position_ids=position_ids)", False),
    ("    create_causal_mask(attention_mask=attention_mask)", True),
    ("    kw = {'attention_mask': attention_mask, 'position_ids': position_ids}\n    create_causal_mask(**kw)", False),
    ("    kw = {'attention_mask': attention_mask}\n    create_causal_mask(**kw)", True),
    ("    kw = dict(position_ids=position_ids)\n    other = {**kw, 'x': x}\n    create_causal_mask(**other)", False),
    ("    kw = {'position_ids': position_ids}\n    local = kw.copy()\n"
     "    create_sliding_window_causal_mask(**local)", False),
    ("    fn = create_causal_mask if x is None else create_sliding_window_causal_mask\n    fn(attention_mask=x)", True),
    ("    pass", False),  # no mask function: nothing to say
])
def test_the_code_reader(body, ignores, tmp_path):
    assert (mask_without_positions(_forward(body, tmp_path)) is not None) is ignores


@pytest.mark.parametrize("strategy", [{"pp": 2}, {"cp": 2}], ids=["pp2", "cp2"])
def test_the_check_of_packed_rows_says_why_gpt_oss_differs(strategy):
    world = strategy.get("pp", 1) * strategy.get("cp", 1)
    report = sw.check(build("gpt_oss", "GptOssForCausalLM"), packed, strategy=strategy, world_size=world, steps=1)
    assert not report.ok and report.first_mismatch.phase == "forward" and report.first_mismatch.step == 0
    assert report.notes[0].startswith("the batch packs documents (its position_ids restart) and model (GptOssModel) "
                                      "builds its causal mask without the position ids"), report.notes


@pytest.mark.parametrize("strategy", [{"pp": 2}, {"cp": 2}], ids=["pp2", "cp2"])
def test_packed_rows_of_a_family_that_passes_the_positions_train_like_one_process(strategy):
    world = strategy.get("pp", 1) * strategy.get("cp", 1)
    report = sw.check(build("mistral", "MistralForCausalLM"), packed, strategy=strategy, world_size=world, steps=2)
    assert report.ok, str(report)
