"""whole/gather.py's coalesced gathers: `full_state_dict`, `full_optimizer_state_dict` and sw.check's gradients
gather many tensors in few all-gathers (consecutive tensors of one shard group, dtype and device share one, up to
BATCH_BYTES), bit-identical to one gather per tensor whatever the batch boundaries fall. Uneven pieces (odd sizes
over 2 and 3 ranks), a float64 tensor between float32 ones (a dtype change cuts a batch), AdamW with weight decay."""

from __future__ import annotations

import pytest
import torch
from parity import CONFIG, batch
from torch import nn

import shardwise as sw
from shardwise import layout
from shardwise.models import GPT
from shardwise.whole import gather


class Float64(nn.Module):
    """A float64 tensor in a unit of its own (a sharding unit holds one dtype)."""

    def __init__(self, g: torch.Generator) -> None:
        super().__init__()
        self.c = nn.Parameter(torch.randn(3, 3, generator=g, dtype=torch.float64))

    def forward(self) -> torch.Tensor:
        return self.c.sum().float()


class Mixed(nn.Module):
    """Odd-sized float32 tensors and a float64 one, so a rank's pieces are uneven and a batch must end at the dtype."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = nn.Parameter(torch.randn(7, 5, generator=g))
        self.b = nn.Parameter(torch.randn(13, generator=g))
        self.f64 = Float64(g)
        self.d = nn.Parameter(torch.randn(11, 2, generator=g))
        self.e = nn.Parameter(torch.randn(1, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.a + self.b[:5]
        return (y.sum() * self.f64() + (self.d.sum() * self.e).squeeze() * y.mean()).square()


def _gathers(model: nn.Module, fn) -> tuple[object, int]:
    """fn()'s result and the all-gathers it issued on the model's shard group."""
    group = next(pl.flat_group for pl in layout.placements(model).values() if pl.flat_group is not None)
    with group.stats.measure() as counted:
        result = fn()
    return result, counted.calls("all_gather")


def _body(comm):
    original = {k: v.clone() for k, v in Mixed().state_dict().items()}
    model = sw.ZeRO(Mixed(), comm, stage=3, wrap=Float64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(comm.rank))
    model(x).backward()
    opt.step()
    states, state_gathers = _gathers(model, lambda: sw.full_state_dict(model))
    optim, optim_gathers = _gathers(model, lambda: sw.full_optimizer_state_dict(model, opt))
    return original, states, state_gathers, optim, optim_gathers


@pytest.mark.parametrize("world", [2, 3])
def test_coalesced_gathers_equal_one_gather_per_tensor_in_fewer_collectives(world, monkeypatch):
    coalesced = sw.launch(_body, world)
    monkeypatch.setattr(gather, "BATCH_BYTES", 1)  # every tensor in its own all-gather, as before coalescing
    one_each = sw.launch(_body, world)
    for (original, states, n_states, optim, n_optim), (_, states1, n_states1, optim1, n_optim1) in zip(coalesced,
                                                                                                     one_each):
        assert n_states1 == 5 and n_optim1 == 10  # five parameters; exp_avg and exp_avg_sq of each
        # In parameter order (a module's own parameters, then its children's): float32 a, b, d, e | float64 f64.c;
        # the optimizer's exp_avg and exp_avg_sq of each, in the same two runs.
        assert n_states == 2 and n_optim == 2
        assert states.keys() == original.keys()
        for name, value in states.items():
            assert value.dtype == original[name].dtype and torch.equal(value, states1[name]), name
        assert not torch.equal(states["a"], original["a"])  # trained: the comparison can fail
        assert optim["param_groups"] == optim1["param_groups"]
        for index, entry in optim1["state"].items():
            assert list(optim["state"][index]) == list(entry)  # torch's key order kept
            for key, value in entry.items():
                assert torch.equal(optim["state"][index][key], value), (index, key)


def _tp_zero3_body(comm):
    """dp=2 x tp=2, ZeRO-3 over dp: every parameter's gathers in both steps, coalesced or one at a time."""
    mesh = sw.Mesh(comm, dp=2, tp=2)
    model = sw.parallelize(GPT(CONFIG, seed=0), mesh, tp_plan="gpt", dp_strategy="zero3")
    initial = sw.full_state_dict(model)  # the unwrapped model's own weights, bit for bit
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    x, y = batch(0, mesh.coords.dp, 2)
    model.step(x, y)
    opt.step()
    return (initial, sw.full_state_dict(model), sw.full_optimizer_state_dict(model, opt),
            mesh.tp.stats.calls("all_gather"))


def test_tensor_parallel_slices_gather_coalesced_too(monkeypatch):
    initials, states, optims, tp_gathers = zip(*sw.launch(_tp_zero3_body, 4))
    monkeypatch.setattr(gather, "BATCH_BYTES", 1)
    _, states1, optims1, tp_gathers1 = zip(*sw.launch(_tp_zero3_body, 4))
    want = GPT(CONFIG, seed=0).state_dict()
    for initial, state, state1, optim, optim1 in zip(initials, states, states1, optims, optims1):
        assert initial.keys() == want.keys() and all(torch.equal(initial[k], want[k]) for k in want)
        assert state.keys() == want.keys()
        assert all(torch.equal(state[k], state1[k]) and state[k].shape == want[k].shape for k in want)
        for index, entry in optim1["state"].items():
            assert all(torch.equal(optim["state"][index][key], value) for key, value in entry.items())
    assert max(tp_gathers) * 3 < min(tp_gathers1), (tp_gathers, tp_gathers1)  # many tensors per step-2 all-gather
