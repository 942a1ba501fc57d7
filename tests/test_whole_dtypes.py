"""Whole-model tools in the gradients' own dtypes: clipping a float64 model returns torch's norm (it used to raise:
"the dtype of the input (Double) should be convertible without narrowing ... (Float)"), half-precision gradients
are clipped too, and the grad scaler and full state dicts keep the model's dtype."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import shardwise as sw

_lock = threading.Lock()  # thread ranks share torch's global RNG: build the seeded model one rank at a time
X = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))


def build(dtype: torch.dtype) -> nn.Module:
    with _lock:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3)).to(dtype)


def reference(dtype: torch.dtype, norm_type: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model = build(dtype)
    model(X.to(dtype)).square().mean().backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01, norm_type)
    return norm, [p.grad.clone() for p in model.parameters()]


WRAPS = {"plain": lambda m, c: m, "ddp": lambda m, c: sw.DDP(m, c), "zero3": lambda m, c: sw.ZeRO(m, c, stage=3),
         "tensor_parallel": lambda m, c: sw.tensor_parallel.parallelize(m, c, {"0": "colwise", "2": "rowwise"})}


def _clip(comm, wrap, dtype, norm_type):
    model = WRAPS[wrap](build(dtype), comm)
    rows = X if wrap in ("plain", "tensor_parallel") else X[2 * comm.rank : 2 * comm.rank + 2]
    model(rows.to(dtype)).square().mean().backward()
    norm = sw.clip_grad_norm_(model, 0.01, norm_type)
    grads = [p.grad.clone() for p in model.parameters()]
    return norm, grads, {k: v.dtype for k, v in sw.full_state_dict(model).items()}


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
@pytest.mark.parametrize("wrap", list(WRAPS))
def test_float64_clip_returns_torchs_norm(wrap, norm_type):
    want, want_grads = reference(torch.float64, norm_type)
    world = 1 if wrap == "plain" else 2
    for norm, grads, dtypes in sw.launch(_clip, world, wrap, torch.float64, norm_type):
        assert norm.dtype == torch.float64
        torch.testing.assert_close(norm, want, rtol=1e-12, atol=0)
        assert set(dtypes.values()) == {torch.float64}
        if wrap == "ddp":  # whole gradients: clipped like torch's, to float64 precision
            for got, exp in zip(grads, want_grads):
                torch.testing.assert_close(got, exp, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_gradients_clip_under_zero2(dtype):
    """fp32 accumulation of the norm (torch's foreach norm widens half too): within the dtype's rounding."""
    want, _ = reference(dtype, 2.0)
    for norm, grads, _ in sw.launch(lambda comm: _clip(comm, "zero3", dtype, 2.0), 2):
        assert norm.dtype == torch.float32
        torch.testing.assert_close(norm, want.float(), rtol=2e-2, atol=0)
        assert all(g.dtype == dtype for g in grads)


def test_grad_scaler_steps_a_float64_model_under_zero3():
    def body(comm):
        model = sw.ZeRO(build(torch.float64), comm, stage=3)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
        scaler = sw.ShardedGradScaler(model)
        scaler.scale(model(X[2 * comm.rank : 2 * comm.rank + 2].double()).square().mean()).backward()
        taken = scaler.step(opt)
        scaler.update()
        return taken, sw.full_state_dict(model)

    model = build(torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    model(X.double()).square().mean().backward()
    opt.step()
    for taken, state in sw.launch(body, 2):
        assert taken
        for key, value in model.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=1e-10, atol=1e-12)
