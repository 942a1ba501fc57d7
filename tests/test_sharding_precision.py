"""Mixed precision: bf16 trains close to fp32; fp16 with the sharded scaler skips an overflowing step on every rank."""

from __future__ import annotations

import torch
from parity import CONFIG, batch

import shardwise as sw
from shardwise.sharded_tensor import local
from shardwise.models import GPT
from shardwise.models.gpt import Block

STEPS = 12


def _losses(comm, param_dtype):
    mp = sw.MixedPrecision(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
    model = sw.ZeRO(GPT(CONFIG, seed=0), comm, stage=3, wrap=Block, mixed_precision=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, comm.rank, comm.size)
        loss = model(x, y)
        assert loss.dtype == (param_dtype or torch.float32)
        loss.backward()
        global_loss = loss.detach().float().reshape(1)
        comm.all_reduce(global_loss, sw.ReduceOp.AVG)
        losses.append(global_loss.item())
        opt.step()
        opt.zero_grad()
    dtypes = {p.dtype for p in model.parameters()}
    return losses, dtypes


def test_bf16_tracks_fp32_loss():
    fp32, _ = sw.launch(_losses, 2, None)[0]
    bf16, master_dtypes = sw.launch(_losses, 2, torch.bfloat16)[0]
    assert master_dtypes == {torch.float32}  # the optimizer updates fp32 master shards
    assert bf16[-1] < bf16[0] - 0.5  # it trains
    # bf16 keeps ~3 significant digits: the stated tolerance is 2% of the loss at every step.
    for a, b in zip(fp32, bf16):
        assert abs(a - b) <= 0.02 * a, (fp32, bf16)


def _fp16_with_injected_overflow(comm):
    mp = sw.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32)
    model = sw.ZeRO(GPT(CONFIG, seed=0), comm, stage=2, wrap=Block, mixed_precision=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = sw.ShardedGradScaler(comm, init_scale=1024.0)
    taken, scales, changed = [], [], []
    for step in range(4):
        x, y = batch(step, comm.rank, comm.size)
        scaler.scale(model(x, y)).backward()
        if step == 2 and comm.rank == 1:
            grads = [local(p.grad) for p in model.parameters() if p.grad is not None and local(p.grad).numel()]
            grads[0].view(-1)[0] = float("inf")  # an overflow in rank 1's shard only (its piece: local)
        before = [local(p).detach().clone() for p in model.parameters()]
        taken.append(scaler.step(opt))
        changed.append(any(not torch.equal(a, local(p)) for a, p in zip(before, model.parameters())))
        scaler.update()
        scales.append(scaler.get_scale())
        opt.zero_grad()
    return taken, changed, scales


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere():
    for taken, changed, scales in sw.launch(_fp16_with_injected_overflow, 2):
        assert taken == [True, True, False, True]
        assert changed == [True, True, False, True]
        assert scales == [1024.0, 1024.0, 512.0, 512.0]
