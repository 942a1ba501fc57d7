"""Gradient hooks registered on parameters before wrapping keep running under strategies that replace the parameter
objects (ZeRO / FSDP's unsharded copies, tensor parallel's slices); they used to be dropped silently (found by
`shardwise check` on a planted bug). A post-accumulate-grad hook, which could never fire there, is refused."""

from __future__ import annotations

import threading

import pytest
import torch
from parity import assert_state_close
from torch import nn

import shardwise as sw
from shardwise import tensor_parallel as tp

_lock = threading.Lock()
X = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))


def build(mask: bool = True) -> nn.Module:
    """Hooks on the dense parameters: a full-shape gradient mask (or a plain scale) and a scale."""
    with _lock:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 2))
    keep = torch.zeros(4, 6)
    keep[:, :3] = 1.0
    model[0].weight.register_hook((lambda g: g * keep) if mask else (lambda g: 0.5 * g))  # freeze half the inputs
    model[2].bias.register_hook(lambda g: 3.0 * g)
    return model


def reference(mask: bool = True) -> dict[str, torch.Tensor]:
    model = build(mask)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.0)
    for _ in range(2):
        model(X).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


WRAPS = {"zero3": lambda m, c: sw.ZeRO(m, c, stage=3), "zero2": lambda m, c: sw.ZeRO(m, c, stage=2),
         "shard_grad_op": lambda m, c: sw.FSDP(m, c, sharding="shard_grad_op"),
         "ddp": lambda m, c: sw.DDP(m, c),
         "tp": lambda m, c: tp.parallelize(m, c, {"0": "colwise", "2": "rowwise"})}


@pytest.mark.parametrize("name", list(WRAPS))
def test_gradient_hooks_registered_before_wrapping_still_run(name):
    """Under tensor parallel a hook sees this rank's slice: the shape-free scale works (the full-shape mask fails
    loudly, below)."""
    mask = name != "tp"

    def body(comm):
        model = WRAPS[name](build(mask), comm)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.0)
        rows = X if name == "tp" else X[2 * comm.rank : 2 * comm.rank + 2]
        for _ in range(2):
            model(rows).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return {k: v.clone() for k, v in sw.full_state_dict(model).items()}

    want = reference(mask)
    if mask:
        assert torch.equal(want["0.weight"][:, 3:], build()[0].weight.detach()[:, 3:])  # the mask froze them
    for got in sw.launch(body, 2):
        assert_state_close(got, want)


def test_a_post_accumulate_grad_hook_is_refused_by_zero():
    def body(comm):
        model = nn.Linear(3, 3)
        model.weight.register_post_accumulate_grad_hook(lambda p: None)
        with pytest.raises(ValueError, match=r"parameter 'weight' has a post-accumulate-grad hook"):
            sw.ZeRO(model, comm, stage=2)

    sw.launch(body, 2)


def test_a_full_shape_hook_on_a_tensor_parallel_slice_fails_loudly():
    def body(comm):
        model = tp.parallelize(build(), comm, {"0": "colwise", "2": "rowwise"})
        with pytest.raises(RuntimeError, match="must match the size"):
            model(X).square().mean().backward()

    sw.launch(body, 2)
