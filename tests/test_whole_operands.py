"""Whole tensors meeting a wrapped model's pieces: `p.copy_(pretrained)`, `p.add_(delta)`, `p.mul_(mask)`,
`w.mul_(scale[:, None])` mean the whole tensor's elements at the piece's place, as in one process.

Before, an elementwise operation of a ZeRO / FSDP piece or tensor-parallel slice with a plain tensor of the
parameter's shape was refused (the message was about EMAs), and one broadcasting to it (a per-row scale) was
refused on flat pieces and, on a tensor-parallel slice, broadcast against the slice. Each test compares the wrapped
model after the same edits with one process's, then trains both with AdamW (weight decay)."""

from __future__ import annotations

import threading

import pytest
import torch
from parity import assert_state_close, small_mlp, train_mlp
from torch import nn

import shardwise as sw
from shardwise import tensor_parallel as tp
from shardwise.models import GPT, GPTConfig

_lock = threading.Lock()
CONFIG = GPTConfig.preset("tiny", n_layers=2)
WRAPS = {
    "zero1": lambda m, c: sw.ZeRO(m, c, stage=1),
    "zero3": lambda m, c: sw.ZeRO(m, c, stage=3),
    "fsdp_units": lambda m, c: sw.FSDP(m, c, wrap=(nn.Linear,)),
}


def built() -> nn.Module:
    with _lock:
        return small_mlp()


def edits(model: nn.Module) -> None:
    """Load a weight, merge a low-rank delta, prune by a mask, scale rows, and an out-of-place mix, in place."""
    g = torch.Generator().manual_seed(3)
    pretrained = torch.randn(8, 6, generator=g)
    delta = torch.randn(8, 2, generator=g) @ torch.randn(2, 8, generator=g) * 0.1
    mask = (torch.rand(8, 8, generator=g) > 0.3).float()
    rows = torch.rand(1, generator=g) + torch.rand(8, generator=g)
    with torch.no_grad():
        model[0].weight.copy_(pretrained)
        model[2].weight.add_(delta)
        model[2].weight.mul_(mask)
        model[2].bias.mul_(rows)
        model[4].weight.mul_(torch.full((1, 8), 0.5))
        model[0].bias.copy_(torch.where(model[0].bias > 0, model[0].bias, torch.zeros(8)) + torch.ones(8))


def edited_and_trained(model: nn.Module, rank: int, world: int) -> tuple[dict, dict]:
    edits(model)
    after = {k: v.clone() for k, v in sw.full_state_dict(model).items()}
    train_mlp(model, lambda m, x, y: ((m(x) - y) ** 2).mean(), rank, world, steps=3)
    return after, {k: v.clone() for k, v in sw.full_state_dict(model).items()}


@pytest.mark.parametrize("name", list(WRAPS))
def test_whole_operands_are_cut_to_the_piece(name):
    want_after, want_trained = edited_and_trained(built(), 0, 1)

    def body(comm):
        return edited_and_trained(WRAPS[name](built(), comm), comm.rank, comm.size)

    for after, trained in sw.launch(body, 2):
        for key in want_after:
            assert torch.equal(after[key], want_after[key]), key
        assert_state_close(trained, want_trained)


def test_whole_operands_on_tensor_parallel_slices():
    """A fused QKV (three boxes per rank), a row-parallel weight and a per-output-row scale that the slice alone
    could not broadcast: one process's values."""
    g = torch.Generator().manual_seed(4)
    d = CONFIG.d_model
    qkv, proj, scale = torch.randn(3 * d, d, generator=g), torch.randn(d, d, generator=g), torch.rand(3 * d, 1, generator=g)

    def edit(model: nn.Module) -> dict:
        block = model.blocks[0].attn
        with torch.no_grad():
            block.qkv.weight.copy_(qkv)
            block.qkv.weight.mul_(scale)
            block.proj.weight.add_(proj)
        return {k: v.clone() for k, v in sw.full_state_dict(model).items()}

    want = edit(GPT(CONFIG, seed=0))

    def body(comm):
        return edit(tp.parallelize(GPT(CONFIG, seed=0), comm, "gpt"))

    for got in sw.launch(body, 2):
        for key in want:
            assert torch.equal(got[key], want[key]), key


def test_a_whole_target_updated_from_a_piece_is_still_refused():
    """`ema.lerp_(p)` with `ema` kept whole would mix one rank's piece into every element: refused, naming it."""

    def body(comm):
        model = sw.ZeRO(built(), comm, stage=3)
        ema = torch.zeros(8, 6)
        with pytest.raises(RuntimeError, match="0.weight.*EMA"):
            with torch.no_grad():
                ema.lerp_(model[0].weight, 0.5)
        return True

    assert all(sw.launch(body, 2))
