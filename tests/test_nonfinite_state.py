"""Non-finite values never poison state (issue 33): a step whose gradients are not finite on any rank leaves every
stateful method's persistent state exactly as it was, and state that becomes non-finite anyway raises, naming it.

Each acceptance test runs, on 2 thread ranks, the same small regression model twice from one initial state: a run
whose loss is NaN on rank 1 at step 1, and a reference that never sees step 1's batch. With sw.ShardedGradScaler the
NaN step is skipped on every rank, the method's state after it (and after the scaler's update, which halves the
scale) equals the state before it (torch.equal), and each of the next 10 steps is taken with the reference's loss
within 1% (in fact exactly: the residuals are kept in gradient units, so the halved loss scale changes nothing).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.compression import BF16, OneBit, OneBitAdam, PowerSGD, RandomK, TopK

STEPS = 12  # step 1 is the NaN step; steps 2..11 are the 10 compared
NAN_STEP, NAN_RANK, WORLD, BATCH, DIM = 1, 1, 2, 16, 16


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8))


torch.manual_seed(0)
INIT = {k: v.clone() for k, v in _model().state_dict().items()}  # built before launch: thread ranks share the RNG
TEACHER = torch.randn(DIM, 8, generator=torch.Generator().manual_seed(1))


def model() -> nn.Module:
    m = _model()
    m.load_state_dict(INIT)
    return m


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's half of global batch `step`: x and a noisy linear teacher's targets."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, DIM, generator=g)
    y = torch.tanh(x @ TEACHER) + 0.1 * torch.randn(BATCH, 8, generator=g)
    half = BATCH // WORLD
    return x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half]


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def state_copy(state: dict) -> dict:
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def assert_equal_state(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for k in want:
        if isinstance(want[k], torch.Tensor):
            assert torch.equal(got[k], want[k]), f"{what}: {k} changed"
        else:
            assert got[k] == want[k], f"{what}: {k} changed"


def scaled_run(comm, net, opt, scaler, state_of, nan: bool, *, after_step=None, steps: int = STEPS):
    """Train `net` for `steps` steps with the scaler (the reference skips step 1's batch instead). Returns
    {step: (loss, taken)} and the state before / after the NaN step."""
    out, before, after = {}, None, None
    for step in range(steps):
        if step == NAN_STEP and not nan:
            continue
        if step == NAN_STEP:
            before = state_copy(state_of())
        x, y = batch(step, comm.rank)
        loss = nn.functional.mse_loss(net(x), y)
        if nan and step == NAN_STEP and comm.rank == NAN_RANK:
            loss = loss * float("nan")
        scaler.scale(loss).backward()
        taken = scaler.step(opt)
        scaler.update()
        if after_step is not None:
            after_step()
        opt.zero_grad()
        out[step] = (float(loss.detach()), taken)
        if step == NAN_STEP:
            after = state_copy(state_of())
    return out, before, after


def check_runs(nan_run, ref_run, before, after) -> None:
    taken = {s: t for s, (_, t) in nan_run.items()}
    assert taken[NAN_STEP] is False, "the NaN step was taken"
    later = [s for s in taken if s > NAN_STEP]
    assert len(later) >= 10 and all(taken[s] for s in later), f"later steps skipped: {taken}"
    assert_equal_state(after, before, "the state after the skipped step")
    for s in later:
        got, want = nan_run[s][0], ref_run[s][0]
        assert abs(got - want) <= 0.01 * abs(want), f"step {s}: loss {got} vs {want} without the NaN step"


# ---- gradient compressors under DDP and ZeRO-2 ----------------------------------------------------------------------

METHODS = [BF16(error_feedback=True), TopK(0.1), RandomK(0.1), OneBit(), PowerSGD(2, start_iter=0)]


def compressed_body(comm, strategy: str, method):
    def wrap():
        if strategy == "ddp":
            return sw.DDP(model(), comm, bucket_mb=0.002, first_bucket_mb=0.001, compression=method)
        return sw.ZeRO(model(), comm, stage=2, compression=method)

    runs = []
    for nan in (True, False):
        net = wrap()
        runs.append(scaled_run(comm, net, adamw(net.parameters()), sw.ShardedGradScaler(net),
                               net.compressor.state_dict, nan))
    (nan_run, before, after), (ref_run, _, _) = runs
    assert any(k.startswith("memory/") for k in before), "the method had no state before the NaN step"
    check_runs(nan_run, ref_run, before, after)


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
@pytest.mark.parametrize("method", METHODS, ids=repr)
def test_nan_step_leaves_compressor_state_unchanged(method, strategy):
    sw.launch(compressed_body, WORLD, strategy, method)


def test_dgc_velocity_unchanged_by_a_nan_step():
    sw.launch(compressed_body, WORLD, "ddp", TopK(0.1, momentum_correction=0.5))


# ---- 1-bit Adam: its momentum, variance and error feedback --------------------------------------------------------

def onebit_adam_body(comm):
    runs = []
    for nan in (True, False):
        net = model()
        opt = OneBitAdam(net.parameters(), comm, lr=1e-2, weight_decay=0.1, freeze_step=1)

        def state_of(opt=opt):
            flat = {f"{i}/{k}": v for i, s in enumerate(opt.state.values()) for k, v in s.items()}
            flat.update({f"compressor/{k}": v for k, v in opt.compressor.state_dict().items()})
            return {**flat, "steps": opt.steps}

        runs.append(scaled_run(comm, net, opt, sw.ShardedGradScaler(comm), state_of, nan))
    (nan_run, before, after), (ref_run, _, _) = runs
    check_runs(nan_run, ref_run, before, after)


def test_nan_step_leaves_onebit_adam_state_unchanged():
    sw.launch(onebit_adam_body, WORLD)


# ---- local SGD and DiLoCo: anchors, outer momentum, the inner-step count ------------------------------------------

def local_sgd_body(comm, kind: str, scaler_of: str, call_step: bool):
    def wrap():
        if kind == "diloco":
            return sw.DiLoCo(model(), comm, sync_every=2)
        return sw.LocalSGD(model(), comm, sync_every=2, compression=TopK(0.25) if kind == "compressed" else None)

    def state_of(net):
        state = state_copy({k: v for k, v in net.outer_state_dict().items() if k in ("inner_steps", "syncs")})
        state.update({f"anchor/{k}": v.clone() for k, v in net.outer_state_dict()["anchors"].items()})
        outer = net.outer_optimizer
        if outer is not None:
            state.update({f"outer/{i}/{k}": v.clone() for i, s in outer.state_dict()["state"].items()
                          for k, v in s.items()})
        if net.compressor is not None:
            state.update({f"compressor/{k}": v for k, v in net.compressor.state_dict().items()})
        return state

    runs = []
    for nan in (True, False):
        net = wrap()
        scaler = sw.ShardedGradScaler(comm if scaler_of == "comm" else net)
        # With a scaler built from the model each worker decides alone (local SGD reduces no gradient): the NaN
        # step is skipped on rank 1 only, and the reference drops step 1's batch on that rank only.
        nan_here = nan or (scaler_of == "model" and comm.rank != NAN_RANK)
        # Rank 0 then counts one inner step more than rank 1: one step more keeps their numbers of syncs equal.
        runs.append(scaled_run(comm, net, adamw(net.parameters()), scaler, lambda net=net: state_of(net),
                               nan_here, after_step=net.step if call_step else None,
                               steps=STEPS + (scaler_of == "model")))
    (nan_run, before, after), (ref_run, _, _) = runs
    if scaler_of == "model" and comm.rank != NAN_RANK:
        return  # this rank trained every batch in both runs
    check_runs(nan_run, ref_run, before, after)


@pytest.mark.parametrize("kind,scaler_of,call_step", [
    ("local_sgd", "comm", False), ("diloco", "comm", False), ("compressed", "comm", False),
    ("diloco", "model", True)])
def test_nan_step_leaves_local_sgd_state_unchanged(kind, scaler_of, call_step):
    sw.launch(local_sgd_body, WORLD, kind, scaler_of, call_step)


# ---- state that becomes non-finite anyway raises, naming it -------------------------------------------------------

def unscaled_nan_body(comm, method, scaler: str):
    net = sw.DDP(model(), comm, bucket_mb=0.002, first_bucket_mb=0.001, compression=method)
    opt = adamw(net.parameters())
    gs = None if scaler == "none" else sw.ShardedGradScaler(comm if scaler == "comm" else net,
                                                            enabled=scaler != "disabled")
    for step in range(4):
        x, y = batch(step, comm.rank)
        loss = nn.functional.mse_loss(net(x), y)
        if step == NAN_STEP and comm.rank == NAN_RANK:
            loss = loss * float("nan")
        if gs is None:
            loss.backward()
            opt.step()
        else:
            gs.scale(loss).backward()
            gs.step(opt)
            gs.update()
        opt.zero_grad()


@pytest.mark.parametrize("method,scaler,pattern", [
    (PowerSGD(2, start_iter=0), "none", r"PowerSGD's (Q|error-feedback memory) of bucket '\d+' holds \d+ "
                                        r"non-finite values after step 2"),
    (TopK(0.1), "disabled", r"TopK's error-feedback memory of bucket '\d+' holds \d+ non-finite values after step 2"),
    (RandomK(0.1), "comm", r"sw.ShardedGradScaler\(model\)"),
], ids=["powersgd-no-scaler", "topk-disabled-scaler", "randomk-scaler-of-comm"])
def test_non_finite_compressor_state_raises_naming_it(method, scaler, pattern):
    with pytest.raises(Exception, match=pattern):
        sw.launch(unscaled_nan_body, WORLD, method, scaler)


def _four_steps_with_a_nan(net, opt, comm):
    """Four steps of `net` / `opt`, the loss made NaN at NAN_STEP on NAN_RANK (no scaler to skip it)."""
    for step in range(4):
        x, y = batch(step, comm.rank)
        loss = nn.functional.mse_loss(net(x), y)
        (loss * float("nan") if step == NAN_STEP and comm.rank == NAN_RANK else loss).backward()
        opt.step()
        opt.zero_grad()


def diloco_nan_body(comm):
    net = sw.DiLoCo(model(), comm, sync_every=2)
    _four_steps_with_a_nan(net, adamw(net.parameters()), comm)


def test_diloco_non_finite_outer_gradient_raises_naming_it():
    with pytest.raises(Exception, match=r"DiLoCo: the averaged outer gradient of '0\.weight' holds \d+ non-finite "
                                        r"values at sync 1"):
        sw.launch(diloco_nan_body, WORLD)


def onebit_adam_nan_body(comm):
    net = model()
    _four_steps_with_a_nan(net, OneBitAdam(net.parameters(), comm, lr=1e-2, freeze_step=1), comm)


def test_onebit_adam_non_finite_momentum_raises_naming_it():
    with pytest.raises(Exception, match=r"OneBitAdam's momentum \(exp_avg\) of parameter 0 \(shape \(32, 16\)\) "
                                        r"holds \d+ non-finite values after step 2"):
        sw.launch(onebit_adam_nan_body, WORLD)
