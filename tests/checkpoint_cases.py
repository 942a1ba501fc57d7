"""Rank bodies of the checkpoint tests: train under a strategy, optionally loading before and saving after.

The global batch is 12 sequences so 2, 3 and 4 ranks all split it evenly. Averaging over 3 ranks divides by 3,
which is not exact in binary, so gradients carry a little more rounding noise than with 2 or 4 ranks; AdamW's eps
is 1e-4 here (instead of parity.py's 1e-6) to keep Adam from amplifying that noise on near-zero gradients beyond
the fp32 tolerance. The optimizer state is still Adam's (exp_avg, exp_avg_sq, step), which is what these tests move.
"""

from __future__ import annotations

import torch
from parity import CONFIG, CORPUS
from sharding_cases import wrap

import shardwise as sw
from shardwise.models import GPT

GLOBAL_BATCH = 12


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-4)


def build(comm, name):
    model = GPT(CONFIG, seed=0)
    if name == "ddp":
        return sw.DDP(model, comm)
    return wrap(model, comm, name)


def train(comm, name, steps, load=None, save=None):
    """Train `steps` steps under `name`, resuming from `load` and saving to `save` if given; return full state."""
    model = build(comm, name)
    opt = make_optimizer(model.parameters())
    start = 0
    if load is not None:
        start = sw.load_checkpoint(load, model, opt)["step"]
    for step in range(start, start + steps):
        x, y = CORPUS.batch(step, GLOBAL_BATCH // comm.size, CONFIG.seq_len, rank=comm.rank, world_size=comm.size)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    if save is not None:
        sw.save_checkpoint(save, model, opt, step=start + steps, data={"next_step": start + steps})
    return sw.full_state_dict(model)


def load_and_resave(comm, name, source, target):
    """Load under a new layout and save again, so the reloaded state can be compared tensor by tensor."""
    model = build(comm, name)
    opt = make_optimizer(model.parameters())
    extra = sw.load_checkpoint(source, model, opt)
    sw.save_checkpoint(target, model, opt, step=extra["step"])
    return extra


def reference(steps):
    model = GPT(CONFIG, seed=0)
    opt = make_optimizer(model.parameters())
    for step in range(steps):
        x, y = CORPUS.batch(step, GLOBAL_BATCH, CONFIG.seq_len)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def state_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ in any bit (or exist on one side only)."""
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))
