"""Writes to the parameters that bump no version counter reach the next forward under every sharding layout.

ZeRO-1/2, FSDP's shard_grad_op and ZeRO-3 with an offloaded optimizer keep a gathered (or device) copy of the
parameters and tell it is stale by the version counter of the master shard, which torch's in-place kernels bump. Two
common writes do not: a fused optimizer step (`AdamW(fused=True)`, nanoGPT's choice on a GPU; `SGD(fused=True)`)
and a write through `.data` (`p.data.copy_(ema)` to evaluate an EMA, `p.data.clamp_()` weight clipping). Before,
both were lost on the other ranks' pieces, silently: fused AdamW under ZeRO-1 ended 0.025 off one process after
three steps, and a `.data` write before an evaluation was seen only in this rank's own piece."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise as sw
from tests.parity import assert_state_close, mlp_batch, small_mlp

WRAPS = {
    "zero1": lambda m, c: sw.ZeRO(m, c, stage=1),
    "zero2": lambda m, c: sw.ZeRO(m, c, stage=2),
    "zero3": lambda m, c: sw.ZeRO(m, c, stage=3),
    "zero3-offload": lambda m, c: sw.ZeRO(m, c, stage=3, cpu_offload="optimizer"),
    "fsdp-shard_grad_op": lambda m, c: sw.FSDP(m, c, sharding="shard_grad_op"),
}
OPTIMIZERS = {
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1, eps=1e-5, fused=True),
    "sgd-fused": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.1, fused=True),
}


build, batch = small_mlp, mlp_batch


def train(model: nn.Module, make_optimizer, rank: int = 0, world: int = 1) -> nn.Module:
    opt = make_optimizer(model.parameters())
    for step in range(3):
        x, y = batch(step, rank, world)
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("name", list(WRAPS))
def test_a_fused_optimizer_step_reaches_every_rank(name, optimizer):
    want = train(build(), OPTIMIZERS[optimizer]).state_dict()

    def body(comm):
        model = train(WRAPS[name](build(), comm), OPTIMIZERS[optimizer], comm.rank, comm.size)
        return {k: v.clone() for k, v in sw.full_state_dict(model).items()}

    for got in sw.launch(body, 2):
        assert_state_close(got, want)


def evaluate_after_writes(model: nn.Module, rank: int = 0, world: int = 1) -> list[float]:
    """One AdamW step, then writes through `.data` with no optimizer step before the next forward (an EMA swapped
    in for evaluation, then weight clipping), each followed by an evaluation on the same batch."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1, eps=1e-5)
    x, y = batch(0, rank, world)
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
    opt.zero_grad()
    x, y = batch(1)
    losses = []
    with torch.no_grad():
        for write in (lambda p: p.data.copy_(p.data * 0.5), lambda p: p.data.clamp_(-0.2, 0.2)):
            for p in model.parameters():
                write(p)
            losses.append(float(((model(x) - y) ** 2).mean()))
    return losses


def assert_losses_as_one_process(name: str, run) -> None:
    """`run(model, rank, world)`'s losses under the wrapper `name` on 2 ranks equal one process's."""
    want = run(build())
    for got in sw.launch(lambda comm: run(WRAPS[name](build(), comm), comm.rank, comm.size), 2):
        assert got == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("name", list(WRAPS))
def test_a_write_through_data_reaches_the_next_forward(name):
    assert_losses_as_one_process(name, evaluate_after_writes)


@pytest.mark.parametrize("name", ["zero1", "zero3", "fsdp-shard_grad_op"])
def test_assigning_data_of_a_piece_is_refused(name):
    """`p.data = x` would make the piece a tensor of its own, no longer the shard the engine gathers and the
    optimizer steps: training went on and left the model as it was, silently (0.13 off one process after three
    AdamW steps). Refused, naming the in-place way."""
    def body(comm):
        model = WRAPS[name](build(), comm)
        weight = model[0].weight
        with pytest.raises(RuntimeError, match=r"assigning 0.weight.data replaces the storage of a .* piece.*write "
                                               r"in place instead \(p.data.copy_\(x\)"):
            weight.data = weight.data.clone()
        weight.data.copy_(weight.data * 2)  # the in-place way is allowed
        return True

    assert sw.launch(body, 2) == [True, True]


def train_with_ema(model: nn.Module, rank: int = 0, world: int = 1, decay: float = 0.9) -> float:
    """Three AdamW steps with an exponential moving average of the parameters kept as the wrapped model's pieces
    (what the refusal below recommends), then the loss of the EMA weights, copied in for the evaluation."""
    ema = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1, eps=1e-5)
    for step in range(3):
        x, y = batch(step, rank, world)
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            torch._foreach_lerp_(ema, [p.detach() for p in model.parameters()], 1 - decay)
    x, y = batch(5)
    with torch.no_grad():
        for p, e in zip(model.parameters(), ema):
            p.data.copy_(e)
        return float(((model(x) - y) ** 2).mean())


@pytest.mark.parametrize("name", ["zero1", "zero3", "fsdp-shard_grad_op"])
def test_an_ema_kept_as_pieces_matches_one_process(name):
    assert_losses_as_one_process(name, train_with_ema)


@pytest.mark.parametrize("name", ["zero1", "zero3", "fsdp-shard_grad_op"])
def test_an_averaged_model_of_whole_tensors_updated_from_pieces_is_refused(name):
    """torch.optim.swa_utils.AveragedModel built before wrapping (a deep copy of the plain model), updated from
    the wrapped one: each whole tensor would be lerped towards this rank's piece (before: a size mismatch naming
    nothing, or a silent broadcast of a one-element piece). Refused, naming the EMA kept as pieces."""
    def body(comm):
        model = build()
        ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn())
        model = WRAPS[name](model, comm)
        with pytest.raises(RuntimeError, match=r"combines a whole tensor of shape .* piece.*AveragedModel.*Keep the "
                                               r"average as pieces"):
            ema.update_parameters(model)
        return True

    assert sw.launch(body, 2) == [True, True]
