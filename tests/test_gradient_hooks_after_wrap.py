"""Gradient hooks on the parameters a wrapped model yields see one process's gradient.

Optimizer-in-backward (`p.register_post_accumulate_grad_hook(lambda p: opts[p].step())`, torchtune's memory saver)
and per-parameter gradient transforms (`p.register_hook(lambda g: g.clamp(-c, c))`) registered after wrapping:
under ZeRO / FSDP the parameters are shard parameters, which autograd never reaches, so neither hook ever ran and the
model silently did not train; under DDP autograd ran them on this rank's gradient, before averaging, so each rank's
optimizer stepped on its own gradient and a clamp clipped the wrong numbers. Each test trains against one process
running the same hooks, with AdamW and weight decay."""

from __future__ import annotations

import threading

import pytest
import torch
from parity import assert_state_close, mlp_batch, small_mlp, train_mlp
from torch import nn

import shardwise as sw

_lock = threading.Lock()
WRAPS = {
    "ddp": lambda m, c: sw.DDP(m, c),
    "zero1": lambda m, c: sw.ZeRO(m, c, stage=1),
    "zero2": lambda m, c: sw.ZeRO(m, c, stage=2),
    "zero3": lambda m, c: sw.ZeRO(m, c, stage=3),
    "fsdp_units": lambda m, c: sw.FSDP(m, c, wrap=(nn.Linear,)),
    "no_shard": lambda m, c: sw.FSDP(m, c, sharding="no_shard"),
}


def built() -> nn.Module:
    with _lock:
        return small_mlp()


def adamw(params) -> torch.optim.Optimizer:
    """train_mlp's optimizer, for one parameter."""
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-5)


def mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def optimizer_in_backward(model: nn.Module, rank: int, world: int) -> tuple[dict, list[int]]:
    """One AdamW per parameter, stepped by its post-accumulate-grad hook; no optimizer.step() in the loop."""
    steps: list[int] = []
    optimizers = {p: adamw([p]) for p in model.parameters()}

    def step(p: torch.Tensor) -> None:
        steps.append(1)
        optimizers[p].step()
        optimizers[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)
    for i in range(4):
        mse(model, *mlp_batch(i, rank, world)).backward()
    return {k: v.clone() for k, v in sw.full_state_dict(model).items()}, [len(steps)]


def clamped(model: nn.Module, rank: int, world: int) -> tuple[dict, list[int]]:
    """A gradient clamp (not linear: clamping each rank's gradient then averaging is not clamping the average)."""
    for p in model.parameters():
        p.register_hook(lambda g: g.clamp(-0.02, 0.02))
    train_mlp(model, mse, rank, world)
    return {k: v.clone() for k, v in sw.full_state_dict(model).items()}, []


@pytest.mark.parametrize("name", list(WRAPS))
@pytest.mark.parametrize("train", [optimizer_in_backward, clamped], ids=["optimizer_in_backward", "clamp"])
def test_hooks_registered_after_wrapping_see_the_averaged_gradient(name, train):
    want, want_count = train(built(), 0, 1)

    def body(comm):
        return train(WRAPS[name](built(), comm), comm.rank, comm.size)

    for got, count in sw.launch(body, 2):
        assert count == want_count  # each hook ran once per parameter per backward, as in one process
        assert_state_close(got, want)


def test_a_hook_registered_before_ddp_wraps_is_held_back_too():
    """Under DDP the parameters are the model's own: a hook registered before wrapping is on them as well."""

    def clamp_first(model: nn.Module) -> nn.Module:
        for p in model.parameters():
            p.register_hook(lambda g: g.clamp(-0.02, 0.02))
        return model

    reference, _ = clamped(built(), 0, 1)

    def body(comm):
        model = train_mlp(sw.DDP(clamp_first(built()), comm), mse, comm.rank, comm.size)
        return {k: v.clone() for k, v in sw.full_state_dict(model).items()}

    for got in sw.launch(body, 2):
        assert_state_close(got, reference)
