"""sw.check with context parallel in the strategy ({"cp": 2, ...}): each rank feeds its chunks of every sequence and
the check computes their loss (check/sequences.py). Clean: shardwise's GPT (an (x, y) batch), Gemma 2 (soft-capped
attention) and GPT-OSS (attention sinks, experts over ep, ZeRO-3). A planted bug, the one context parallel had
before it implemented the soft cap (the attention function dropping Gemma 2's ``softcap``), is found at step 0; what
cannot be checked is refused by name."""

from __future__ import annotations

import sys

import pytest
import torch
from hf_cases import gemma2, gpt_oss

from shardwise.check import check
from shardwise.check.example import build_gpt, gpt_batch

transformers = pytest.importorskip("transformers")

cp_hf = sys.modules["shardwise.context_parallel.hf"]


def tokens(step):
    ids = torch.randint(1, 64, (4, 16), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


def adamw(params):  # eps 1e-5: Gemma 2's sharp scores leave gradients whose rounding noise eps=1e-6 would amplify
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-5)


def test_the_gpt_over_cp_is_clean():
    report = check(build_gpt, gpt_batch, strategy={"cp": 2}, world_size=2, steps=2)
    assert report.ok, str(report)
    assert "cp=2 (ring attention) x ddp over dp=1 x cp=2 on 2 thread ranks" in str(report)


@pytest.mark.parametrize("build, strategy, world", [
    (gemma2, {"cp": 2, "cp_method": "ulysses", "dp_strategy": "ddp"}, 4),
    (gpt_oss, {"cp": 2, "ep": 2, "dp_strategy": "zero3"}, 4)], ids=["gemma2-cp2-ulysses-dp2", "gpt_oss-cp2-ep2-zero3"])
def test_huggingface_decoders_over_cp_are_clean(build, strategy, world):
    report = check(build, tokens, strategy=strategy, world_size=world, steps=2, optimizer=adamw)
    assert report.ok, str(report)


def phimoe_windowed():
    """Phi-MoE applies config.sliding_window to every layer through its mask alone (its attention is not told)."""
    return transformers.PhimoeForCausalLM(transformers.PhimoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
        router_jitter_noise=0.0, input_jitter_noise=0.0, sliding_window=5, attn_implementation="eager"))


def test_a_window_the_model_applies_through_its_mask_alone_is_kept():
    """Before, context parallel took the window only from the attention's keyword: Phi-MoE's window of 5 was
    dropped and its step-0 loss differed from one process's (4.1669 vs 4.1735)."""
    report = check(phimoe_windowed, tokens, strategy={"cp": 2, "cp_method": "ring"}, world_size=2, steps=2,
                   optimizer=adamw)
    assert report.ok, str(report)


def test_a_dropped_soft_cap_is_found_at_step_0(monkeypatch):
    right = cp_hf.hf_attention

    def without_cap(module, q, k, v, mask, scaling=None, dropout=0.0, **kwargs):
        return right(module, q, k, v, mask, scaling, dropout, **{**kwargs, "softcap": None})

    monkeypatch.setattr(cp_hf, "hf_attention", without_cap)
    report = check(gemma2, tokens, strategy={"cp": 2}, world_size=2, steps=1, optimizer=adamw)
    assert not report.ok
    assert (report.first_mismatch.step, report.first_mismatch.phase) == (0, "forward"), str(report)


@pytest.mark.parametrize("kwargs, words", [
    (dict(strategy={"cp": 2}, loss_fn=lambda model, batch: model(**batch).loss), ["loss_fn cannot be combined"]),
    (dict(strategy={"cp": 2, "cp_method": "stripes"}), ["cp_method='stripes'", "'ulysses'"]),
    (dict(strategy={"cp": 3}), ["tp=1 x cp=3 does not divide world_size=2"]),
    (dict(strategy={"cp": 2, "dp_strategy": "none"}), ["dp=1 x cp=2", "name dp_strategy"]),
])
def test_bad_context_parallel_input_is_refused(kwargs, words):
    with pytest.raises(ValueError) as info:
        check(build_gpt, gpt_batch, **kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_the_command_line_takes_cp_and_ep(capsys):
    from shardwise_cli import main

    assert main(["check", "--gpt", "--cp", "2", "--strategy", "ddp", "-n", "2", "--steps", "2"]) == 0
    assert "cp=2 (ring attention) x ddp over dp=1 x cp=2" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["check", "--gpt", "--cp-method", "ulysses"])
    assert "--cp-method needs --cp > 1" in capsys.readouterr().err


def padded_tokens(step):
    """Rows padded to unequal lengths: the dp ranks hold different label counts."""
    batch = tokens(step)
    labels = batch["input_ids"].clone()
    for row, length in enumerate((16, 3, 11, 6)):
        labels[row, length:] = -100
    return {"input_ids": batch["input_ids"], "labels": labels}


def test_padded_labels_over_dp_and_cp_are_the_global_batchs_mean():
    """The check's loss under cp divides by the label count over the dp ranks (GlobalCausalLMLoss): before, each dp
    rank's mean over its own labels was averaged, and a padded batch showed a false difference."""
    report = check(gemma2, padded_tokens, strategy={"cp": 2, "dp_strategy": "ddp"}, world_size=4, steps=2,
                   optimizer=adamw)
    assert report.ok, str(report)
