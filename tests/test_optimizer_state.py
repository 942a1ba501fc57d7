"""Optimizer state dicts of sharded models (issue 29): `sw.full_optimizer_state_dict` gives one process's
`optimizer.state_dict()` (torch's format, full shapes), torch's own `optimizer.state_dict()` on pieces raises naming
it, and a full dict (ours or a one-process optimizer's) loads into any layout, through `optimizer.load_state_dict`
unchanged or `sw.load_full_optimizer_state_dict`, and resumes exactly. AdamW with weight decay in two groups (by
`p.dim()`, as nanoGPT builds them), tiny GPT, 2 thread ranks."""

from __future__ import annotations

import copy

import pytest
import torch
from parity import CONFIG, batch

import shardwise as sw
from shardwise.models import GPT

WRAPS = {
    "zero1": lambda m, c: sw.ZeRO(m, c, stage=1),
    "zero3": lambda m, c: sw.ZeRO(m, c, stage=3),
    "fsdp": lambda m, c: sw.FSDP(m, c),
    "tp": lambda m, c: sw.tensor_parallel.parallelize(m, c, "gpt"),
}


def optimizer(model):
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-3, eps=1e-6)


def _rows(name, comm, step):
    return batch(step) if name == "tp" else batch(step, comm.rank, comm.size)


def _steps(model, opt, rows, steps):
    for step in steps:
        model(*rows(step)).backward()
        opt.step()
        opt.zero_grad()


def _one_process(steps=2):
    model = GPT(CONFIG, seed=0)
    opt = optimizer(model)
    _steps(model, opt, batch, range(steps))
    return copy.deepcopy(opt.state_dict())


def _assert_same(got, want, exact=False):
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for i, entry in want["state"].items():
        assert got["state"][i].keys() == entry.keys()
        for key, value in entry.items():
            tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-7}
            torch.testing.assert_close(got["state"][i][key], value, **tol, msg=lambda m: f"state {i} {key}: {m}")


@pytest.mark.parametrize("name", list(WRAPS))
def test_the_full_optimizer_state_is_one_processes_and_torchs_own_is_refused(name):
    def body(comm):
        model = WRAPS[name](GPT(CONFIG, seed=0), comm)
        opt = optimizer(model)
        _steps(model, opt, lambda s: _rows(name, comm, s), range(2))
        with pytest.raises(RuntimeError, match=r"sw.full_optimizer_state_dict\(model, optimizer\)"):
            opt.state_dict()
        return sw.full_optimizer_state_dict(model, opt)

    want = _one_process()
    for got in sw.launch(body, 2):
        _assert_same(got, want)


@pytest.mark.parametrize("name", ["zero3", "tp"])
@pytest.mark.parametrize("how", ["torch_load_before_step", "sw_load"])
def test_a_saved_full_state_resumes_exactly_in_a_fresh_wrapped_model(name, how):
    def body(comm):
        rows = lambda s: _rows(name, comm, s)  # noqa: E731
        model = WRAPS[name](GPT(CONFIG, seed=0), comm)
        opt = optimizer(model)
        _steps(model, opt, rows, range(2))
        saved = (sw.full_state_dict(model), copy.deepcopy(sw.full_optimizer_state_dict(model, opt)))
        _steps(model, opt, rows, range(2, 4))
        resumed = WRAPS[name](GPT(CONFIG, seed=1), comm)  # other weights: all must come from the checkpoint
        sw.load_full_state_dict(resumed, saved[0])
        opt2 = optimizer(resumed)
        if how == "sw_load":
            sw.load_full_optimizer_state_dict(resumed, opt2, saved[1])
        else:  # nanoGPT's resume: torch's own call, before the first step; sliced into the pieces at that step
            opt2.load_state_dict(saved[1])
            # read back before any step (nanoGPT checkpoints at its first iteration): the gathers must pair even on
            # a rank whose piece of a tensor is all of it while the other's is empty
            _assert_same(sw.full_optimizer_state_dict(resumed, opt2), saved[1], exact=True)
        _steps(resumed, opt2, rows, range(2, 4))
        return sw.full_state_dict(model), sw.full_state_dict(resumed), sw.full_optimizer_state_dict(model, opt), \
            sw.full_optimizer_state_dict(resumed, opt2)

    for went_on, resumed, opt_went_on, opt_resumed in sw.launch(body, 2):
        for key in went_on:
            assert torch.equal(went_on[key], resumed[key]), key
        _assert_same(opt_resumed, opt_went_on, exact=True)


def test_a_one_process_optimizer_state_loads_into_a_sharded_model_after_its_first_step():
    """torch's load_state_dict of a full dict once the guard watches the optimizer: sliced on the way in."""
    want = _one_process(steps=3)

    def body(comm):
        model = sw.ZeRO(GPT(CONFIG, seed=0), comm, stage=3)
        opt = optimizer(model)
        _steps(model, opt, lambda s: batch(s, comm.rank, comm.size), range(1))
        opt.load_state_dict(copy.deepcopy(want))
        return sw.full_optimizer_state_dict(model, opt)

    for got in sw.launch(body, 2):
        _assert_same(got, want, exact=True)


def test_the_sharded_grad_scaler_disabled_passes_everything_through():
    def body(comm, enabled):
        model = sw.ZeRO(GPT(CONFIG, seed=0), comm, stage=3)
        opt = optimizer(model)
        scaler = sw.ShardedGradScaler(model, enabled=enabled)
        for step in range(2):
            scaler.scale(model(*batch(step, comm.rank, comm.size))).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return sw.full_state_dict(model), scaler.get_scale(), scaler.is_enabled()

    off, on = sw.launch(body, 2, False)[0], sw.launch(body, 2, True)[0]
    assert off[1:] == (1.0, False) and on[1:] == (2.0**16, True)
    for key in off[0]:
        torch.testing.assert_close(off[0][key], on[0][key], rtol=1e-5, atol=1e-6)  # scaling is exact in fp32
    with pytest.raises(ValueError, match="enabled='yes' must be True or False"):
        sw.ShardedGradScaler(torch.nn.Linear(2, 2), enabled="yes")


def test_torchs_load_state_dict_of_a_one_process_checkpoint_loads_each_ranks_piece():
    want = GPT(CONFIG, seed=3).state_dict()

    def body(comm):
        model = sw.ZeRO(GPT(CONFIG, seed=0), comm, stage=3)
        result = model.load_state_dict(want)  # torch's own call, a full state dict, no collective
        return result, sw.full_state_dict(model)

    for result, got in sw.launch(body, 2):
        assert not result.missing_keys and not result.unexpected_keys
        for key in want:
            assert torch.equal(got[key], want[key]), key
