"""The MoE GPT, batches and training loop shared by the expert-parallel tests (test_experts.py: DDP;
test_experts_zero.py: ZeRO / FSDP): one process's reference and the sharded runs train the same way.

Adam divides by sqrt(v), which hides a gradient that is wrong by a constant factor, so `train` also returns the
first step's gradients gathered whole, and the clipping norms (the clip binds at every step of the reference)."""

from __future__ import annotations

import torch

from shardwise import layout
from shardwise.models import GPT, GPTConfig
from shardwise.whole.gather import gather_full

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2, n_experts=8, experts_per_token=2,
                moe_aux_loss_coef=0.1)
GLOBAL_BATCH, STEPS, MAX_NORM = 8, 3, 0.3
RTOL, ATOL = 1e-5, 1e-6


def batch(step, rank=0, world=1):
    """Rows [rank B / world, (rank + 1) B / world) of the global batch of step `step`."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, CFG.vocab_size, (GLOBAL_BATCH, CFG.seq_len), generator=g)
    y = torch.randint(0, CFG.vocab_size, (GLOBAL_BATCH, CFG.seq_len), generator=g)
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    return x[rows], y[rows]


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-5, weight_decay=0.1)


def train(model, step_batch, clip, steps=STEPS):
    """`steps` steps; returns (first step's gradients by name, norms, losses)."""
    opt, grads, norms, losses = optimizer(model.parameters()), None, [], []
    for step in range(steps):
        x, y = step_batch(step)
        loss = model(x, y)
        loss.backward()
        if grads is None:
            grads = {name: gather_full(pl, pl.param.grad).clone() for name, pl in layout.placements(model).items()}
        norms.append(float(clip(model, MAX_NORM)))
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
    return grads, norms, losses


def one_process():
    """(state dict, first step's gradients, norms, losses) of one process on the global batch; the clip binds."""
    model = GPT(CFG, seed=0)
    grads, norms, losses = train(model, batch, lambda m, n: torch.nn.utils.clip_grad_norm_(m.parameters(), n))
    assert min(norms) > MAX_NORM  # the clipping binds
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, grads, norms, losses
