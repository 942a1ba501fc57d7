"""A MoE GPT's load-balancing loss through pipeline stages and microbatches (balance_loss.py): per microbatch.

With pp > 1 or n_microbatches > 1, `sw.parallelize` computes the Switch balance loss of each microbatch over global
microbatch j (the j-th microbatch of every data-parallel rank) and carries its running sum from stage to stage. The
reference is one process accumulating over those global microbatches (each loss / n_microbatches), then a binding
clip and an AdamW step (weight decay), three times, float64: every parameter to 1e-10 and the ranks' mean loss to
one process's. The one-process run on the whole batch at once differs (the balance loss is a product of batch means),
so the microbatch semantics is what is checked. Cases: dp2 x pp2 (zero1), four microbatches with activation
checkpointing (zero3), pp = 1 with two microbatches (ddp), experts over ep2 (zero2), tp2 with sequence parallel x
pp2, and cp2 x pp2 x dp2 (fsdp); then `predict` returns the logits alone. `sw.check` accumulates its one process over
the same microbatches."""

from __future__ import annotations

import pytest
import torch
from float64_gpts import ROWS, T, VOCAB, moe_gpt
from float64_gpts import adamw as optimizer
from float64_gpts import tokens as batch

import shardwise as sw

STEPS, MAX_NORM = 3, 0.1


def global_microbatch(j, dp, microbatches):
    """The rows of global microbatch j: the j-th microbatch of each data-parallel rank's contiguous rows."""
    rows = ROWS // dp
    size = rows // microbatches
    return torch.cat([torch.arange(d * rows + j * size, d * rows + (j + 1) * size) for d in range(dp)])


def one_process(dp, microbatches):
    """(state dict, losses) of one process accumulating over the global microbatches (microbatches=0: the whole
    batch in one forward)."""
    model = moe_gpt()
    opt = optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        parts = [global_microbatch(j, dp, microbatches) for j in range(microbatches)] or [torch.arange(ROWS)]
        total = 0.0
        for rows in parts:
            loss = model(x[rows], y[rows]) / len(parts)
            loss.backward()
            total += float(loss.detach())
        assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)) > MAX_NORM
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def train(comm, axes, options):
    mesh = sw.Mesh(comm, **axes)
    model = sw.parallelize(moe_gpt(), mesh, **options)
    opt = optimizer(model.parameters())
    rows = ROWS // mesh.sizes["dp"]
    mine = slice(mesh.coords.dp * rows, (mesh.coords.dp + 1) * rows)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        losses.append(float(model.step(x[mine], y[mine])))
        sw.clip_grad_norm_(model, MAX_NORM)
        opt.step()
        opt.zero_grad()
    state = sw.full_state_dict(model)
    model.eval()
    logits = model.predict(batch(STEPS)[0][mine])
    return state, losses, tuple(logits.shape)


CASES = {
    "dp2_pp2_zero1": ({"dp": 2, "pp": 2}, {"dp_strategy": "zero1", "n_microbatches": 2}),
    "dp2_pp2_4mb_ac_zero3": ({"dp": 2, "pp": 2}, {"dp_strategy": "zero3", "n_microbatches": 4,
                                                   "activation_checkpointing": True}),
    "dp2_pp1_2mb_ddp": ({"dp": 2}, {"n_microbatches": 2}),
    "ep2_pp2_zero2": ({"dp": 2, "pp": 2, "ep": 2}, {"dp_strategy": "zero2", "n_microbatches": 2}),
    "tp2_sp_pp2": ({"tp": 2, "pp": 2}, {"tp_plan": "gpt", "sequence_parallel": True, "n_microbatches": 2}),
    "cp2_pp2_dp2_fsdp": ({"dp": 2, "cp": 2, "pp": 2}, {"dp_strategy": "fsdp:full_shard", "n_microbatches": 2}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_balance_loss_per_microbatch_trains_like_one_process_accumulating(case):
    axes, options = CASES[case]
    dp, microbatches = axes.get("dp", 1), options["n_microbatches"]
    want, want_losses = one_process(dp, microbatches)
    world = dp * axes.get("cp", 1) * axes.get("tp", 1) * axes.get("pp", 1)
    results = sw.launch(train, world, axes, options)
    for state, _, shape in results:
        assert state.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(state[name], want[name], rtol=1e-10, atol=1e-10, msg=name)
        assert shape == (ROWS // dp, T, VOCAB)
    mean = torch.tensor([losses for _, losses, _ in results], dtype=torch.float64).mean(0)
    torch.testing.assert_close(mean, torch.tensor(want_losses, dtype=torch.float64), rtol=1e-7, atol=0)


def test_the_whole_batch_at_once_is_another_function():
    """The microbatch reference is not the whole batch's: a product of batch means does not split."""
    per_microbatch, _ = one_process(2, 2)
    whole, _ = one_process(2, 0)
    assert max(float((per_microbatch[k] - whole[k]).abs().max()) for k in whole) > 1e-3


@pytest.mark.parametrize("strategy", [{"pp": 2, "dp_strategy": "zero3", "n_microbatches": 2}, {"pp": 2, "cp": 2}],
                         ids=["dp2_pp2_zero3", "cp2_pp2"])
def test_check_accumulates_its_one_process_over_the_same_microbatches(strategy):
    """sw.check's one process accumulates over the pipeline's global microbatches when the model has a balance loss
    (the loss's value differs by the rounding of GPT.forward's float32 sum of the layers' losses: default
    tolerances)."""
    report = sw.check(moe_gpt, batch, strategy=strategy, world_size=4, steps=2, accumulate=2)
    assert report.ok, str(report)


def test_check_refuses_a_pipeline_whose_microbatches_it_cannot_know():
    def wrap(model, comm):  # a callable strategy: the check's one process cannot know its microbatches
        return sw.parallelize(model, sw.Mesh(comm, pp=2))

    with pytest.raises(ValueError, match="balance loss is computed per microbatch under this pipeline"):
        sw.check(moe_gpt, batch, strategy=wrap, world_size=2, steps=1)
