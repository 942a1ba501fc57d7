"""transformers' model families through sw.check (tests/hf_sweep.py): each trains like one process under every
strategy that applies to it, or is refused with an error naming why.

`make soak` sweeps every causal LM (zero3, fsdp, ddp, ep, tp:hf, pp, cp; and with an attention mask over its
padding, on the right and on the left: zero3, ep, pp, cp, and tp2 with sequence parallel under plan "llama"), masked
LM, encoder-decoder, sequence and token classifier (zero3, ddp:find_unused) and image classifier (zero3,
ddp:find_unused, and ZeRO-3 with batch_norm="sync"): 3971 cases in about 23 minutes on 2 cores, of which 2595 pass
(trained like one process, or refused by name: BatchNorm
without a choice, among others) and the rest skip naming what the family refuses of the generic config (38 causal LMs
do not build or run at the generic sizes) or that the strategy has nothing to split (no experts, no tensor-parallel
plan). `make test` runs two families that exercise the sweep's paths: a Llama, and BART's decoder, whose loss pairs
logits and labels unshifted (refused before token_mean recognised it)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import hf_sweep  # noqa: E402

STRATEGIES = {"causal_lm": ("zero3", "fsdp", "ddp", "ep", "tp:hf", "pp", "cp"),
              "masked_lm": ("zero3", "ddp:find_unused"), "seq2seq": ("zero3", "ddp:find_unused"),
              "seq_cls": ("zero3", "ddp:find_unused"), "token_cls": ("zero3", "ddp:find_unused"),
              "padded_lm": ("zero3", "ep", "pp", "cp", "sp"), "left_padded_lm": ("zero3", "ep", "pp", "cp", "sp"),
              "image_cls": ("zero3", "ddp:find_unused", "zero3+sync")}


def _cases() -> list:
    cases = []
    for kind, strategies in STRATEGIES.items():
        for model_type, class_name in hf_sweep.mapping(kind).items():
            cases += [pytest.param(kind, model_type, class_name, s, id=f"{kind}-{model_type}-{s}") for s in strategies]
    return cases


def _assert_trains_or_is_refused(kind: str, model_type: str, class_name: str, strategy: str) -> str:
    result = hf_sweep.outcome(model_type, class_name, strategy, kind)
    assert not result.startswith("DIFFERS"), f"{class_name} under {strategy}: {result}"
    return result


@pytest.mark.parametrize(("model_type", "class_name", "strategy"),
                         [("llama", "LlamaForCausalLM", "zero3"), ("bart", "BartForCausalLM", "ddp:find_unused")])
def test_two_families_train_like_one_process(model_type, class_name, strategy):
    assert _assert_trains_or_is_refused("causal_lm", model_type, class_name, strategy) == "ok"


@pytest.mark.soak
@pytest.mark.parametrize(("kind", "model_type", "class_name", "strategy"), _cases())
def test_every_family_trains_like_one_process_or_is_refused(kind, model_type, class_name, strategy):
    result = _assert_trains_or_is_refused(kind, model_type, class_name, strategy)
    if result.startswith("unbuildable"):
        pytest.skip(f"the generic tiny config does not fit {class_name}: {result}")
    if result.startswith("inapplicable"):
        pytest.skip(f"{class_name} under {strategy}: {result}")
