"""HuggingFace's `save_pretrained` on wrapped models (shardwise/hf_save.py). Under DDP it died with RecursionError
(transformers' unwrap_model follows `model.module`, which shardwise's in-place wrappers return as the model itself);
under tensor parallel it wrote garbage without an error (safetensors copied each piece's bytes as the whole
tensor). Now: DDP's `model.module.save_pretrained(dir)` on rank 0 saves the model; ZeRO-3, FSDP and tensor parallel
refuse naming the collective recipe, which saves what one process would (reloaded with `from_pretrained`), its
config naming the model's own class."""

from __future__ import annotations

import json

import pytest
import torch
from hf_cases import gpt_oss, tiny_llama

import shardwise as sw
from shardwise import tensor_parallel as tp

transformers = pytest.importorskip("transformers")

WRAPS = {"zero3": lambda m, c: sw.ZeRO(m, c, stage=3), "fsdp": lambda m, c: sw.FSDP(m, c),
         "tp": lambda m, c: tp.parallelize(m, c, "llama")}


def test_ddp_model_module_save_pretrained_on_rank_0(tmp_path):
    want = tiny_llama().state_dict()

    def body(comm):
        model = sw.DDP(tiny_llama(), comm)
        if comm.rank == 0:
            model.module.save_pretrained(tmp_path)  # torch DDP scripts' idiom

    sw.launch(body, 2)
    saved = transformers.LlamaForCausalLM.from_pretrained(tmp_path).state_dict()
    assert all(torch.equal(saved[k], want[k]) for k in want)
    assert _architectures(tmp_path) == ["LlamaForCausalLM"]  # what vLLM and pipelines pick the class by


@pytest.mark.parametrize("wrap", list(WRAPS))
def test_split_models_refuse_then_save_by_the_recipe(wrap, tmp_path):
    """GPT-OSS under tensor parallel has its sinks split too (the "head_rows" style)."""
    build = gpt_oss if wrap == "tp" else tiny_llama
    want = build().state_dict()

    def body(comm):
        model = WRAPS[wrap](build(), comm)
        with pytest.raises(ValueError, match=r"save_pretrained on a model split over ranks .* would write this "
                                             r"rank's pieces.*state = sw.full_state_dict\(model\) \(collective\)"):
            model.save_pretrained(tmp_path / "pieces")
        state = sw.full_state_dict(model)
        if comm.rank == 0:
            model.save_pretrained(tmp_path / "full", state_dict=state)

    sw.launch(body, 2)
    assert not (tmp_path / "pieces").exists()
    saved = type(build()).from_pretrained(tmp_path / "full").state_dict()
    assert sorted(saved) == sorted(want)
    assert all(torch.equal(saved[k], want[k]) for k in want)
    # the class's own name, not the wrappers' mixed-in one ("SavePretrainedTokenMeanShardedLlamaForCausalLM")
    assert _architectures(tmp_path / "full") == [type(build()).__name__]


def _architectures(directory) -> list[str]:  # noqa: ANN001
    return json.loads((directory / "config.json").read_text())["architectures"]


@pytest.mark.parametrize("wrap", ["zero3", "tp"])
def test_safetensors_save_file_of_pieces_is_refused(wrap, tmp_path):
    """safetensors copies numel() elements from each tensor's data_ptr(): from a piece that answers for a larger
    tensor it read past the piece's end and saved garbage. A piece's data_ptr() now raises, naming the fix (or, where
    safetensors first views a tensor this rank holds whole while another rank holds none, the view raises)."""
    from safetensors.torch import save_file

    def body(comm):
        model = WRAPS[wrap](tiny_llama(), comm)
        with pytest.raises(RuntimeError, match=r"(data_ptr|view)\(\) (of|on) .*sw.full_state_dict\(model\)"):
            save_file({k: v.detach() for k, v in model.state_dict().items()}, tmp_path / f"{comm.rank}.safetensors")

    sw.launch(body, 2)
