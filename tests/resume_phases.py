"""Exact resumption, checked the one way: a run of 4 steps against 2 steps, a checkpoint, and a new run that loads it
and makes steps 2-3; the two final states must be equal bit for bit (the loaded RNG states included)."""

from __future__ import annotations

import torch

import shardwise as sw

PHASES = {"straight": range(4), "first": range(2), "second": range(2, 4)}


def train_in_phases(comm, path, phase, build, batch_of):
    """`build(comm)` the wrapped model, AdamW with weight decay over it; `batch_of(step, comm)` the (x, y) of a step."""
    model = build(comm)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.1)
    if phase == "second":
        sw.load_checkpoint(path, model, opt)
    for step in PHASES[phase]:
        x, y = batch_of(step, comm)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    if phase == "first":
        sw.save_checkpoint(path, model, opt, step=2)
    return sw.full_state_dict(model)


def assert_resumed_run_is_exact(world, path, build, batch_of):
    want = sw.launch(train_in_phases, world, path, "straight", build, batch_of)[0]
    sw.launch(train_in_phases, world, path, "first", build, batch_of)
    got = sw.launch(train_in_phases, world, path, "second", build, batch_of)[0]
    assert list(got) == list(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
