"""Inference under every strategy: `model.eval()` and a forward under `torch.no_grad()` give the single-process
model's logits, for DDP, ZeRO-1/2/3, FSDP, tensor parallel (with sequence parallel) and tp x dp compositions.
ZeRO-3 gathers each unit for its forward and frees it after: nothing gathered stays alive and no gradient buffer is
allocated. A model trained a step and then evaluated still matches the single-process model.
"""

from __future__ import annotations

import pytest
import torch
from parity import CONFIG, batch, make_optimizer
from sharding_cases import wrap

import shardwise as sw
from shardwise import tensor_parallel as tp
from shardwise.models import GPT

STRATEGIES = [("ddp", 1, False), ("zero1", 1, False), ("zero2", 1, False), ("zero3", 1, False),
              ("shard_grad_op", 1, False), ("hybrid_shard", 1, False), (None, 2, True), ("zero3", 2, True),
              ("ddp", 2, False)]


def reference():
    model = GPT(CONFIG, seed=0)
    x, y = batch(0)
    model.eval()
    with torch.no_grad():
        before = model(x)
    model.train()
    opt = make_optimizer(model.parameters())
    model(x, y).backward()
    opt.step()
    model.eval()
    with torch.no_grad():
        after = model(x)
    return before, after


def body(comm, strategy, t, sp):
    dp = comm.size // t
    mesh = sw.Mesh(comm, dp=dp, tp=t)
    model = GPT(CONFIG, seed=0)
    if t > 1:
        model = tp.parallelize(model, mesh.tp, "gpt", sequence_parallel=sp)
    if strategy == "ddp":
        model = sw.DDP(model, mesh.dp)
    elif strategy is not None:
        model = wrap(model, mesh.dp, strategy)
    x, y = batch(0)
    model.eval()
    with torch.no_grad():
        before = model(x)  # every rank evaluates the whole batch
    stats = sw.memory_stats(model)
    model.train()
    opt = make_optimizer(model.parameters())
    xs, ys = batch(0, mesh.coords.dp, dp)
    model(xs, ys).backward()
    opt.step()
    opt.zero_grad()
    model.eval()
    with torch.no_grad():
        after = model(x)
    return before, after, stats, sw.memory_stats(model)


@pytest.mark.parametrize("strategy, t, sp", STRATEGIES, ids=[f"{s}-tp{t}{'-sp' if sp else ''}" for s, t, sp in STRATEGIES])
def test_eval_forward_equals_one_process(strategy, t, sp):
    want_before, want_after = reference()
    world = t if strategy is None else 4  # tensor parallel alone: no data-parallel axis
    for before, after, stats, later in sw.launch(body, world, strategy, t, sp):
        torch.testing.assert_close(before, want_before, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(after, want_after, rtol=1e-5, atol=1e-5)
        assert stats.gathered == 0 and later.gathered == 0
        if strategy == "zero3":
            assert stats.gathered_peak > 0 and stats.grads == 0
