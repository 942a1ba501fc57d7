"""A HuggingFace MoE's load-balancing loss (output_router_logits=True, router_aux_loss_coef > 0) through pipeline
stages and microbatches: three AdamW steps (weight decay, eps 1e-5, a binding `sw.clip_grad_norm_`) equal one process
accumulating over the same global microbatches (microbatch j: the j-th microbatch of every data-parallel rank's rows)
with HuggingFace's own functions: each microbatch's ``router_aux_loss_coef x aux_loss / n`` (transformers'
``load_balancing_loss_func``, given the microbatch's attention mask) plus its causal-LM loss divided by the global
batch's label count (``loss_function(..., num_items_in_batch=...)``), as models/hf_router_loss.py defines the loss.

Mixtral on pp=2 (1F1B; interleaved), dp=2 x pp=2 (ZeRO-3, activation checkpointing), pp=1 with two microbatches,
ep=2 x pp=2, tp=2 x pp=2, cp=2 x pp=2 (ring); Qwen2-MoE (a shared expert) and GPT-OSS (sinks, a window) on pp=2.
Padded rows (an attention mask: padding counts for nothing in the router loss) on pp=2, cp=2 x pp=2 and on dp=2
with one microbatch, where the loss is the whole batch's (HuggingFace's, given the mask). The reference taking the
whole batch's router loss differs, so the per-microbatch loss is what is checked. `sw.check` with a pp mesh dict
accumulates its one process the same way and agrees."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_decoders import MAX_NORM, MODELS, STEPS, mixtral, optimizer
from test_parallelize_hf_packed import train

import shardwise as sw

transformers = pytest.importorskip("transformers")

B, T = 4, 16


def plain(step):
    ids = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(300 + step))
    return {"input_ids": ids}, ids.clone()


def padded(step):
    """Row 0 right-padded, row 1 left-padded, row 2 at both ends, row 3 whole; -100 on the padding and on the first
    token after left padding (tests/test_parallelize_hf_packed.py explains why)."""
    ids = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(400 + step))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 11:], mask[1, :3], mask[2, :2], mask[2, 13:] = 0, 0, 0, 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 3], labels[2, 2] = -100, -100
    return {"input_ids": ids, "attention_mask": mask}, labels


def global_microbatches(dp, n):
    """The rows of global microbatch j, for each j: the j-th of n microbatches of every dp rank's B / dp rows."""
    per_rank, size = B // dp, B // (dp * n)
    return [torch.cat([torch.arange(d * per_rank + j * size, d * per_rank + (j + 1) * size) for d in range(dp)])
            for j in range(n)]


def accumulating(model, batch, dp, n):
    """(state dict, gradient norms, losses) of one process over global microbatches (module docstring)."""
    opt = optimizer(model.parameters())
    coef, vocab = model.config.router_aux_loss_coef, model.config.vocab_size
    norms, losses = [], []
    for step in range(STEPS):
        inputs, labels = batch(step)
        items = int((labels[:, 1:] != -100).sum())  # HuggingFace's shifted labels that count
        total = 0.0
        for rows in global_microbatches(dp, n):
            out = model(**{k: v[rows] for k, v in inputs.items()})
            loss = model.loss_function(out.logits, labels[rows], vocab_size=vocab, num_items_in_batch=items)
            loss = loss + coef * out.aux_loss / n
            loss.backward()
            total += float(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        losses.append(total)
        opt.step()
        opt.zero_grad()
    assert min(norms) > MAX_NORM  # the clip binds at every step
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms, losses


CASES = {
    "mixtral_pp2": ("mixtral", {"pp": 2}, {"n_microbatches": 2}, plain),
    "mixtral_pp2_interleaved": ("mixtral", {"pp": 2}, {"n_microbatches": 2, "virtual_stages": 2,
                                                       "pp_schedule": "interleaved_1f1b"}, plain),
    "mixtral_dp2_pp2_zero3_checkpointed": ("mixtral", {"dp": 2, "pp": 2}, {
        "n_microbatches": 2, "dp_strategy": "zero3", "activation_checkpointing": True}, plain),
    "mixtral_dp2_two_microbatches": ("mixtral", {"dp": 2}, {"n_microbatches": 2}, plain),
    "mixtral_ep2_pp2": ("mixtral", {"dp": 2, "ep": 2, "pp": 2}, {"n_microbatches": 2}, plain),
    "mixtral_tp2_pp2": ("mixtral", {"tp": 2, "pp": 2}, {"tp_plan": "llama", "n_microbatches": 2}, plain),
    "mixtral_cp2_pp2_ring": ("mixtral", {"cp": 2, "pp": 2}, {"n_microbatches": 2}, plain),
    "qwen2_moe_pp2": ("qwen2_moe", {"pp": 2}, {"n_microbatches": 4}, plain),
    "gpt_oss_pp2": ("gpt_oss", {"pp": 2}, {"n_microbatches": 2}, plain),
    "mixtral_pp2_padded": ("mixtral", {"pp": 2}, {"n_microbatches": 4}, padded),
    "mixtral_cp2_pp2_padded": ("mixtral", {"cp": 2, "pp": 2}, {"n_microbatches": 2}, padded),
    "mixtral_dp2_padded_whole_batch": ("mixtral", {"dp": 2}, {}, padded),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_router_loss_per_microbatch_trains_like_one_process_accumulating(case):
    kind, axes, options, batch = CASES[case]
    dp, n = axes.get("dp", 1), options.get("n_microbatches", 1)
    want, want_norms, want_losses = accumulating(MODELS[kind](), batch, dp, n)
    if n > 1:  # the whole batch's router loss is another function
        whole, _, _ = accumulating(MODELS[kind](), batch, 1, 1)
        assert max(float((whole[k] - w).abs().max()) for k, w in want.items()) > 1e-4
    world = dp * axes.get("cp", 1) * axes.get("tp", 1) * axes.get("pp", 1)
    results = sw.launch(train, world, MODELS[kind](), axes, options, batch)
    by_rows = {where[0].start: losses for _, _, losses, where in results}
    assert [sum(step) / dp for step in zip(*by_rows.values())] == pytest.approx(want_losses, rel=1e-5)
    trained = MODELS[kind]().eval()
    trained.load_state_dict(want)
    inputs = batch(STEPS)[0]
    with torch.no_grad():
        want_logits = trained(**inputs).logits
    real = inputs.get("attention_mask", torch.ones(B, T)).bool()  # a padding position's output is nobody's
    for state, norms, _, (rows, logits) in results:
        torch.testing.assert_close(logits[real[rows]], want_logits[rows][real[rows]], rtol=1e-5, atol=1e-5)
        assert norms == pytest.approx(want_norms, rel=1e-5)
        assert set(state) == set(want)
        for name in want:
            torch.testing.assert_close(state[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_the_hybrid_says_whether_its_balance_loss_is_per_microbatch():
    model = mixtral()

    def body(comm):
        return [sw.parallelize(copy.deepcopy(model), sw.Mesh(comm, **axes)).balance_loss_per_microbatch
                for axes in ({"pp": 2}, {"dp": 2})]  # 4 microbatches by default, and 1 (the default at pp = 1)

    for flags in sw.launch(body, 2):
        assert flags == [True, False]
