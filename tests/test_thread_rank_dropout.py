"""Thread ranks draw their dropout masks from streams of their own (dropout_stream.use_own_stream), as processes draw
from their own generators.

Before, thread ranks shared torch's one generator: torch.utils.checkpoint restores that generator's state for the
recompute in backward, but the other ranks kept drawing from it meanwhile, so the recompute drew other masks than
the forward and the gradient was another model's, with no error (measured: 18 and 21 of 50 steps on two ranks).
The references are computed: the mask a forward applied (read from its output) against the one its gradient used,
and the same ZeRO-3 training without activation checkpointing (float64, AdamW with weight decay).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from parity import CONFIG, batch
from resume_phases import assert_resumed_run_is_exact
from torch.utils.checkpoint import checkpoint

import shardwise as sw
from shardwise.models import GPT
from shardwise.models.gpt import Block


def masks_disagree(comm, steps=20):
    linear = torch.nn.Linear(64, 64, bias=False)
    torch.nn.init.ones_(linear.weight)
    drop = torch.nn.Dropout(0.5)
    wrong = 0
    for _ in range(steps):
        out = checkpoint(lambda t: drop(linear(t)), torch.ones(8, 64), use_reentrant=False)
        out.sum().backward()
        kept_in_forward = (out != 0).double().sum(0) * 2  # each kept element adds 2 (= 1 / (1 - p)) to its row
        wrong += int(not torch.equal(linear.weight.grad[:, 0].double(), kept_in_forward))
        linear.weight.grad = None
    first = drop(torch.ones(1000))
    return wrong, first


def test_a_recompute_applies_the_mask_its_forward_drew_on_every_thread_rank():
    results = sw.launch(masks_disagree, 2)
    assert [wrong for wrong, _ in results] == [0, 0]
    assert not torch.equal(results[0][1], results[1][1])  # each rank its own masks, as processes seeded apart


def train_zero3(comm, checkpointing):
    config = dataclasses.replace(CONFIG, dropout=0.1)
    model = sw.ZeRO(GPT(config, seed=0).double(), comm, stage=3, wrap=Block, activation_checkpointing=checkpointing)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.1)
    for step in range(3):
        x, y = batch(step, comm.rank, comm.size)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return sw.full_state_dict(model)


def test_zero3_with_activation_checkpointing_trains_as_without_it_under_dropout():
    want = sw.launch(train_zero3, 2, False)[0]
    got = sw.launch(train_zero3, 2, True)[0]
    assert list(got) == list(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_a_resumed_thread_rank_run_draws_the_masks_the_uninterrupted_one_draws(tmp_path):
    config = dataclasses.replace(CONFIG, dropout=0.1)
    assert_resumed_run_is_exact(2, tmp_path, lambda comm: sw.DDP(GPT(config, seed=0).double(), comm),
                                lambda step, comm: batch(step, comm.rank, comm.size))


def recompute_something_else(comm):
    drop = torch.nn.Dropout(0.5)
    scale = [1.0]
    out = checkpoint(lambda t: drop(t * scale[0]), torch.ones(8, 8, requires_grad=True), use_reentrant=False)
    scale[0] = 2.0  # the recompute computes another input than the forward dropped out
    try:
        out.sum().backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_a_thread_rank_recompute_that_cannot_replay_its_masks_is_an_error():
    for message in sw.launch(recompute_something_else, 2):
        assert "this thread rank's dropout stream" in message and "no forward dropped out" in message


def rolled_back(comm):
    from shardwise.elastic.snapshot import capture, restore

    model = sw.DDP(GPT(dataclasses.replace(CONFIG, dropout=0.1), seed=0).double(), comm)
    x, y = batch(0, comm.rank, comm.size)
    snap = capture(0, model, None, None, None)
    first = model(x, y).detach()
    restore(snap, model, None, None, None)
    return first, model(x, y).detach(), model(x, y).detach()


def test_an_elastic_rollback_puts_the_dropout_stream_back():
    for first, again, next_one in sw.launch(rolled_back, 2):
        assert torch.equal(again, first)  # the masks of the forward after the commit, drawn again
        assert not torch.equal(next_one, first)  # and a later forward draws new ones


def compiled_loss(comm, compiled):
    model = sw.DDP(GPT(dataclasses.replace(CONFIG, dropout=0.1), seed=0), comm)
    run = torch.compile(model) if compiled else model
    x, y = batch(0, comm.rank, comm.size)
    loss = run(x, y)
    loss.backward()
    return float(loss.detach())


@pytest.mark.soak  # compiling on two loaded CPU cores takes 10 to 90 s
def test_a_compiled_model_on_thread_ranks_draws_its_masks_from_the_ranks_streams():
    """Under torch.compile each draw is a graph break that runs eagerly (no generator object enters the graph), so the
    compiled model drops out what the eager one does: equal losses up to the compiled kernels' rounding (a different
    mask moves the loss by ~1e-2)."""
    eager = sw.launch(compiled_loss, 2, False)
    compiled = sw.launch(compiled_loss, 2, True, timeout=900)
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-6)
