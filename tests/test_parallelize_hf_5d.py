"""HuggingFace decoders through `sw.parallelize` with context parallel and expert parallel: three AdamW steps (weight
decay, eps 1e-5, a binding `sw.clip_grad_norm_`) equal one process training the same model on the whole batch with
HuggingFace's own loss, ``model(x, labels=x).loss``.

* Gemma (cp=2 x tp=2 Ulysses, pp=2) and Qwen3 (dp=2 x tp=2 ZeRO-3, cp=2), Llama-shaped decoders whose embedding
  scales its output (Gemma) and whose attention normalizes each head (Qwen3).
* Llama with cp=2 (ring and Ulysses), cp=2 x dp=2, cp=2 x tp=2 (the llama plan) and cp=2 x pp=2: the stages give
  each token its global position (zigzag chunks) and no chunk-local mask, and the loss shifts the labels over the
  whole sequence before keeping this rank's positions (models/hf_parallel.py). A batch whose -100 labels fall
  unevenly on the chunks checks that the mean is over the sequence's labels, not a mean of chunk means.
* Mixtral (4 experts, top-2) with its load-balancing loss (output_router_logits=True, router_aux_loss_coef > 0) on
  dp=2 x ep=2 (DDP and ZeRO-3), dp=4 x ep=2 (experts averaged over edp=2), ep=2 x tp=2 and ep=2 x cp=2: the router
  loss is the global batch's.
* Qwen3-MoE on dp=2 x ep=2 x tp=2 and Qwen2-MoE (a gated shared expert) on cp=2 x ep=2 Ulysses, both with the
  load-balancing loss: other classes computing Mixtral's experts and loss (experts/hf_kinds.py).
* GPT-OSS (attention sinks, a sliding-window layer of 8 < T = 16, biased experts, its router loss) on dp=2 x ep=2
  ZeRO-3 and on cp=2 x ep=2 (ring attention with the sinks and the window), and Mistral with a window of 5 on cp=2
  (Ulysses): the window crosses the chunks.
Attention dropout under context parallel is refused at wrap time by name. Each rank's model is a copy of one built
before launch (thread ranks share torch's RNG)."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_decoders import MAX_NORM, MODELS, STEPS, llama, one_process, optimizer
from parity import value_error_text

import shardwise as sw

transformers = pytest.importorskip("transformers")

B, T = 4, 16


def labels_of(step, masked=False):
    """(input_ids, labels) of the global batch; masked: -100 on a few labels, unevenly over the zigzag chunks."""
    ids = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(100 + step))
    labels = ids.clone()
    if masked:
        labels[:, 1:6] = -100  # chunk 0 (positions 0-3) and the start of chunk 1: rank 0 loses more than rank 1
        labels[0, 9:12] = -100
    return ids, labels


_REFERENCES: dict = {}


def reference(kind, masked=False):
    if (kind, masked) not in _REFERENCES:
        def batch(step):
            ids, labels = labels_of(step, masked)
            return {"input_ids": ids}, labels

        _REFERENCES[kind, masked] = one_process(MODELS[kind](), batch)
    return _REFERENCES[kind, masked]


def train(comm, model, axes, options, masked):
    mesh = sw.Mesh(comm, **axes)
    hybrid = sw.parallelize(copy.deepcopy(model), mesh, **options)
    opt = optimizer(hybrid.parameters())
    norms, losses = [], []
    dp, index = mesh.sizes["dp"], mesh.coords.dp
    for step in range(STEPS):
        x, labels = (t[index * B // dp:(index + 1) * B // dp] for t in labels_of(step, masked))
        losses.append(float(hybrid.step(x, labels)))  # every cp rank gets its dp rank's whole sequences
        norms.append(float(sw.clip_grad_norm_(hybrid, MAX_NORM)))
        opt.step()
        opt.zero_grad()
    hybrid.eval()
    logits = hybrid.predict(labels_of(STEPS)[0][index * B // dp:(index + 1) * B // dp])  # cut and gathered again
    return sw.full_state_dict(hybrid), norms, losses, (index, dp, logits)


CASES = {
    "llama_cp2_ring": ("llama", {"cp": 2}, {}),
    "llama_cp2_ulysses": ("llama", {"cp": 2}, {"cp_method": "ulysses"}),
    "llama_cp2_masked_labels": ("llama", {"cp": 2}, {"n_microbatches": 1}),
    "llama_cp2_dp2": ("llama", {"dp": 2, "cp": 2}, {}),
    "llama_cp2_tp2_ulysses": ("llama", {"cp": 2, "tp": 2}, {"tp_plan": "llama", "cp_method": "ulysses"}),
    "llama_cp2_pp2": ("llama", {"cp": 2, "pp": 2}, {"n_microbatches": 2}),
    "gpt2_cp2_ring": ("gpt2", {"cp": 2}, {}),
    "gemma_cp2_tp2_ulysses": ("gemma", {"cp": 2, "tp": 2}, {"tp_plan": "llama", "cp_method": "ulysses"}),
    "gemma_pp2": ("gemma", {"pp": 2}, {"n_microbatches": 2}),
    "qwen3_dp2_tp2_zero3": ("qwen3", {"dp": 2, "tp": 2}, {"tp_plan": "llama", "dp_strategy": "zero3"}),
    "qwen3_cp2_ring": ("qwen3", {"cp": 2}, {}),
    "mixtral_dp2_ep2_ddp": ("mixtral", {"dp": 2, "ep": 2}, {}),
    "mixtral_dp2_ep2_zero3": ("mixtral", {"dp": 2, "ep": 2}, {"dp_strategy": "zero3"}),
    "mixtral_dp2_ep2_checkpointed": ("mixtral", {"dp": 2, "ep": 2}, {"activation_checkpointing": True}),
    "mixtral_dp4_ep2": ("mixtral", {"dp": 4, "ep": 2}, {}),
    "mixtral_ep2_tp2": ("mixtral", {"dp": 2, "ep": 2, "tp": 2}, {"tp_plan": "llama"}),
    "mixtral_ep2_cp2": ("mixtral", {"dp": 1, "cp": 2, "ep": 2}, {}),
    "qwen3_moe_dp2_ep2_tp2": ("qwen3_moe", {"dp": 2, "ep": 2, "tp": 2}, {"tp_plan": "llama"}),
    "qwen2_moe_cp2_ep2_ulysses": ("qwen2_moe", {"dp": 1, "cp": 2, "ep": 2}, {"cp_method": "ulysses"}),
    "gpt_oss_dp2_ep2_zero3": ("gpt_oss", {"dp": 2, "ep": 2}, {"dp_strategy": "zero3"}),
    "gpt_oss_cp2_ep2_ring": ("gpt_oss", {"dp": 1, "cp": 2, "ep": 2}, {}),
    "mistral_window_cp2_ulysses": ("mistral_window", {"cp": 2}, {"cp_method": "ulysses"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hf_model_through_parallelize_trains_like_one_process(case):
    kind, axes, options = CASES[case]
    masked = case.endswith("masked_labels")
    want, want_norms, want_losses = reference(kind, masked)
    world = axes.get("dp", 1) * axes.get("cp", 1) * axes.get("tp", 1) * axes.get("pp", 1)
    results = sw.launch(train, world, MODELS[kind](), axes, options, masked)
    dp = axes.get("dp", 1)
    by_dp = {where[0]: losses for _, _, losses, where in results}
    assert [sum(step) / dp for step in zip(*by_dp.values())] == pytest.approx(want_losses, rel=1e-5)
    trained = MODELS[kind]().eval()
    trained.load_state_dict(want)
    with torch.no_grad():
        want_logits = trained(labels_of(STEPS)[0]).logits
    for state, norms, _, (index, dp, logits) in results:
        torch.testing.assert_close(logits, want_logits[index * B // dp:(index + 1) * B // dp], rtol=1e-5, atol=1e-5)
        assert norms == pytest.approx(want_norms, rel=1e-5)
        assert set(state) == set(want)
        for name in want:
            torch.testing.assert_close(state[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_what_stays_unsupported_is_refused_by_name():
    """Context parallel refuses attention dropout at wrap time (before tensor parallel runs), before anything is
    changed. (Mixtral's router loss under pp > 1 or several microbatches is computed per microbatch:
    tests/test_parallelize_hf_router_microbatches.py.)"""
    dropout = llama(attention_dropout=0.1)

    def body(comm):
        error = value_error_text(lambda: sw.parallelize(dropout, sw.Mesh(comm, cp=2, tp=1)))
        return error, not sw.layout.strategies(dropout)

    for error, untouched in sw.launch(body, 2):
        assert untouched
        assert "attention_dropout=0.1" in error
