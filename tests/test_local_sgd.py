"""Local SGD and DiLoCo: H = 1 equals DDP, larger H trains with H x fewer bytes, outer state round-trips, bad input."""

from __future__ import annotations


import pytest
import torch
from local_sgd_cases import inner_step, outer_state_run, state_of
from parity import CONFIG, assert_state_close, batch

import shardwise as sw
from shardwise.async_sgd import DiLoCo, LocalSGD
from shardwise.models import GPT

LR = 0.1


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)


def reference_sgd(steps: int) -> dict[str, torch.Tensor]:
    """One process, plain SGD on the whole global batch: what DDP gives (the parity contract)."""
    model = GPT(CONFIG, seed=0)
    opt = sgd(model.parameters())
    for step in range(steps):
        x, y = batch(step)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return state_of(model)


def train(comm, wrap: str, steps: int, sync_every: int = 1, inner: str = "sgd"):
    """Train the tiny GPT on this rank's slice of each global batch; return (state, losses, bytes per step)."""
    model = GPT(CONFIG, seed=0)
    if wrap == "ddp":
        model = sw.DDP(model, comm)
    elif wrap == "average":
        model = LocalSGD(model, comm, sync_every=sync_every)
    elif wrap == "diloco_plain":  # outer SGD lr 1, no momentum: plain averaging by another road
        model = DiLoCo(model, comm, sync_every=sync_every, outer_lr=1.0, outer_momentum=0.0)
    elif wrap == "diloco":
        model = DiLoCo(model, comm, sync_every=sync_every)
    opt = sgd(model.parameters()) if inner == "sgd" else torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, traffic = [], []
    for step in range(steps):
        x, y = batch(step, comm.rank, comm.size)
        with comm.stats.measure() as measured:
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if wrap != "ddp":
                model.step()
        losses.append(float(loss.detach()))
        traffic.append(measured.bytes("all_reduce"))
    return state_of(model), losses, traffic


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("wrap", ["average", "diloco_plain"])
def test_sync_every_step_equals_ddp(world, wrap):
    steps = 3
    reference = reference_sgd(steps)
    ddp = sw.launch(train, world, "ddp", steps)
    local = sw.launch(train, world, wrap, steps)
    assert_state_close(ddp[0][0], reference)
    for state, _, _ in local:
        assert_state_close(state, reference)
        assert_state_close(state, ddp[0][0])


def _param_bytes() -> int:
    return sum(p.numel() * p.element_size() for p in GPT(CONFIG, seed=0).parameters())


@pytest.mark.parametrize("wrap", ["average", "diloco"])
def test_larger_h_trains_and_sends_h_times_fewer_bytes(wrap):
    world, h, steps = 2, 4, 12
    results = sw.launch(train, world, wrap, steps, h, "adamw")
    # Replicas are equal after every synchronisation (the last step synchronised: 12 % 4 == 0) ...
    for state, _, _ in results[1:]:
        assert_state_close(state, results[0][0])
    # ... the loss went down ...
    losses = [sum(r[1][i] for r in results) / world for i in range(steps)]
    assert sum(losses[-3:]) / 3 < losses[0] - 0.1, losses
    # ... and only every H-th step sent anything: one all-reduce of the whole model.
    traffic = results[0][2]
    assert [b > 0 for b in traffic] == [(i + 1) % h == 0 for i in range(steps)]
    assert all(b in (0, _param_bytes()) for b in traffic)
    ddp_bytes = sw.launch(train, world, "ddp", 2)[0][2]
    assert sum(traffic) * h == ddp_bytes[0] * steps  # H x fewer bytes than DDP


def test_local_steps_diverge_between_synchronisations():
    """Between synchronisations each worker trains on its own data: replicas differ (nothing is communicated)."""
    results = sw.launch(train, 2, "average", 3, 4, "adamw")
    diff = max((results[0][0][k] - results[1][0][k]).abs().max().item() for k in results[0][0])
    assert diff > 1e-4


def _diloco_run(comm, steps, resume_from=None):
    model = DiLoCo(GPT(CONFIG, seed=0), comm, sync_every=2)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # A fresh run keeps its checkpoint at its first synchronisation (step 2); a resumed one starts after it.
    return outer_state_run(model, comm, opt, steps, resume_from, save_at=2)


def test_outer_state_round_trips_and_resumes_exactly():
    # Uninterrupted: 6 steps, a checkpoint taken at the first synchronisation (after step 2).
    full = sw.launch(_diloco_run, 2, 6)
    checkpoints = [r[1] for r in full]
    outer = full[0][2]
    assert outer["inner_steps"] == 6 and outer["syncs"] == 3
    momentum = outer["outer_optimizer"]["state"][0]["momentum_buffer"]
    assert momentum.abs().max() > 0  # the outer Nesterov momentum is real state, and it is saved
    # Resumed from the checkpoint: 4 more steps land on the same parameters (momentum and counters restored).
    resumed = sw.launch(_diloco_run, 2, 4, checkpoints)
    for (state, _, _), (want, _, _) in zip(resumed, full):
        assert_state_close(state, want)


def test_load_outer_state_dict_mismatches_are_named():
    comm = sw.init()
    plain = LocalSGD(GPT(CONFIG, seed=0), comm, sync_every=2)
    diloco = DiLoCo(GPT(CONFIG, seed=0), comm, sync_every=2)
    with pytest.raises(ValueError, match="saved without an outer optimizer"):
        diloco.load_outer_state_dict(plain.outer_state_dict())
    saved = diloco.outer_state_dict()
    saved["anchors"].pop("head.weight", None) or saved["anchors"].pop(next(iter(saved["anchors"])))
    with pytest.raises(ValueError, match="anchors do not match"):
        diloco.load_outer_state_dict(saved)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8", None])
def test_bad_sync_every_is_named(bad):
    with pytest.raises(ValueError, match=r"sync_every=.* must be a positive int"):
        LocalSGD(GPT(CONFIG, seed=0), sw.init(), sync_every=bad)


def test_bad_options_are_named():
    comm = sw.init()
    with pytest.raises(ValueError, match="outer_optimizer=.*must be None"):
        LocalSGD(GPT(CONFIG, seed=0), comm, sync_every=2, outer_optimizer="sgd")
    with pytest.raises(ValueError, match="outer_lr=0 must be a number > 0"):
        DiLoCo(GPT(CONFIG, seed=0), comm, outer_lr=0)
    with pytest.raises(ValueError, match=r"outer_momentum=1.0 must be a number in \[0, 1\)"):
        DiLoCo(GPT(CONFIG, seed=0), comm, outer_momentum=1.0)
    with pytest.raises(ValueError, match="module must be a torch.nn.Module"):
        LocalSGD("gpt", comm, sync_every=2)
    with pytest.raises(ValueError, match="comm must be a shardwise Communicator"):
        LocalSGD(GPT(CONFIG, seed=0), None, sync_every=2)
    model = LocalSGD(GPT(CONFIG, seed=0), comm, sync_every=2)
    with pytest.raises(ValueError, match="already wrapped by LocalSGD"):
        LocalSGD(model, comm, sync_every=2)


def _wrap_refused(comm, kind):
    model = GPT(CONFIG, seed=0)
    if kind == "tensor_parallel":
        model = sw.tensor_parallel.parallelize(model, comm, plan="gpt")
    elif kind == "zero3":
        model = sw.ZeRO(model, comm, stage=3)
    elif kind == "fsdp":
        model = sw.FSDP(model, comm)
    elif kind == "ddp_same_ranks":
        model = sw.DDP(model, comm)
    elif kind == "pipeline":
        stages = sw.pipeline.partition(model.pipeline_layers(), 2)
        model = sw.pipeline.Pipeline(stages, comm, "1f1b", 2, lambda out, y: out.float().mean())
    try:
        LocalSGD(model, comm, sync_every=4)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("kind, words", [
    ("tensor_parallel", "sharded across ranks by tensor_parallel"),
    ("zero3", "sharded across ranks by zero3"),
    ("fsdp", "sharded across ranks by fsdp"),
    ("pipeline", "pipeline stage"),
    ("ddp_same_ranks", "already synchronised every step by ddp"),
])
def test_models_not_whole_on_every_rank_are_refused(kind, words):
    for message in sw.launch(_wrap_refused, 2, kind):
        assert message is not None and words in message and "allowed: a plain module" in message, message


def _ddp_within_site(comm):
    """DDP inside each 'site' of 2 ranks, DiLoCo across the sites: allowed, and the replicas meet."""
    site = comm.split(comm.rank // 2)
    across = comm.split(comm.rank % 2)
    model = DiLoCo(sw.DDP(GPT(CONFIG, seed=0), site), across, sync_every=2)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(4):
        inner_step(model, opt, comm, step)
    return state_of(model)


def test_ddp_inside_sites_with_diloco_across_sites():
    states = sw.launch(_ddp_within_site, 4)
    for state in states[1:]:
        assert_state_close(state, states[0])


def _plain_loop(comm, wrap: str, steps: int, call_step: bool):
    """The one-process loop, unchanged: no model.step() unless `call_step` (the loop written for the old API)."""
    model = GPT(CONFIG, seed=0)
    model = LocalSGD(model, comm, sync_every=1) if wrap == "average" else \
        sw.async_sgd.StreamingDiLoCo(model, comm, sync_every=2, fragments=2)
    opt = sgd(model.parameters())
    for step in range(steps):
        x, y = batch(step, comm.rank, comm.size)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        if call_step:
            model.step()
    return state_of(model), model.inner_steps


def test_the_plain_loop_synchronises_through_the_optimizers_step():
    """Issue 29: without model.step() the replicas used to train apart (0.042 after 3 steps); the inner optimizer's
    step now counts, so averaging every step is DDP's update again, and an old loop calling model.step() too counts
    each step once."""
    steps = 3
    reference = reference_sgd(steps)
    for call_step in (False, True):
        for state, inner_steps in sw.launch(_plain_loop, 2, "average", steps, call_step):
            assert inner_steps == steps
            assert_state_close(state, reference)


def test_streaming_diloco_counts_the_same_with_and_without_model_step():
    plain = sw.launch(_plain_loop, 2, "streaming", 6, False)
    old = sw.launch(_plain_loop, 2, "streaming", 6, True)
    for (a, na), (b, nb) in zip(plain, old):
        assert na == nb == 6
        for key in a:
            assert torch.equal(a[key], b[key]), key


def test_an_optimizer_over_an_async_sgd_worker_refuses_to_step():
    from shardwise.async_sgd import AsyncSGD

    def body(comm):
        model = AsyncSGD(GPT(CONFIG, seed=0), comm, optimizer=sgd, n_servers=1)
        if model.is_server:
            model.serve()  # its own optimizer over the whole model steps freely here
            return None
        opt = sgd(model.parameters())
        model(*batch(0, 0, 1)).backward()
        with pytest.raises(ValueError, match=r"AsyncSGD worker's parameters.*Call model.step\(\) after backward"):
            opt.step()
        model.step()  # the worker's way
        model.finish()
        return True

    assert sw.launch(body, 2)[0] is True
