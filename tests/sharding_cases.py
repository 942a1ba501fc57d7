"""Shared rank bodies for the sharding tests: train the tiny GPT under a named configuration, return full state.

Configurations are named by strings so that the same bodies run on threads and in spawned gloo processes:
"zero1", "zero2", "zero3", "full_shard", "shard_grad_op", "no_shard", "hybrid_shard" (shard groups of 2).
"""

from __future__ import annotations

import torch
from parity import CONFIG, accumulated_backward, batch, frozen_model, grouped_optimizer, make_optimizer

import shardwise as sw
from shardwise.models.gpt import GPT, Block

CONFIGS = ("zero1", "zero2", "zero3", "full_shard", "shard_grad_op", "no_shard", "hybrid_shard")


def wrap(model, comm, name: str, **options):
    options.setdefault("wrap", Block)
    if name.startswith("zero"):
        return sw.ZeRO(model, comm, stage=int(name[-1]), **options)
    if name.startswith("hybrid_shard"):  # "hybrid_shard" groups of 2; "hybrid_shard1": groups of 1 (all replicas)
        size = int(name[len("hybrid_shard"):] or 2)
        return sw.FSDP(model, comm, sharding="hybrid_shard", shard_size=size, **options)
    return sw.FSDP(model, comm, sharding=name, **options)


def padded_units(name: str, world: int) -> tuple[list[int], int, int, list[int]]:
    """The GPT's units' padded element counts (creation order, the root unit last), the root unit's, the last
    forward unit's (the two units ZeRO-3 keeps gathered from forward into backward, so it gathers them once a step),
    and each unit's reduced gradient buffer: the padded elements plus, in each of the `world` chunks, one used flag
    per trainable tensor (every tensor of the GPT trains)."""
    units = sw.launch(lambda comm: wrap(GPT(CONFIG, seed=0), comm, name).sharding_units(), world)[0]
    padded = [-(-u["params"] // world) * world for u in units]
    reduced = [p + world * u["tensors"] for p, u in zip(padded, units)]
    assert [u["grad_buffer"] for u in units] == reduced, units
    assert units[-2]["unit"] == f"blocks.{CONFIG.n_layers - 1}", units  # units are made in forward order
    return padded, padded[-1], padded[-2], reduced


def _optimizer(model, param_groups: bool) -> torch.optim.Optimizer:
    if param_groups:
        return grouped_optimizer(model.named_parameters())
    return make_optimizer([p for p in model.parameters() if p.requires_grad])


def train_sharded(comm, name, steps=5, accumulate=1, clip=None, freeze=(), param_groups=False, **options):
    """Train under `name`; return (full state dict, per-step CommStats dicts, clip norms)."""
    model = wrap(frozen_model(freeze), comm, name, **options)
    opt = _optimizer(model, param_groups)
    per_step, norms = [], []
    for step in range(steps):
        x, y = batch(step, comm.rank, comm.size)
        with comm.stats.measure() as measured:
            accumulated_backward(model, x, y, accumulate)
        if clip is not None:
            norms.append(float(sw.clip_grad_norm_(model, clip)))
        opt.step()
        opt.zero_grad()
        per_step.append(measured.as_dict())
    return sw.full_state_dict(model), per_step, norms


def reference(steps=5, clip=None, freeze=(), param_groups=False):
    """The same training in one process, plain PyTorch."""
    model = frozen_model(freeze)
    opt = _optimizer(model, param_groups)
    norms = []
    for step in range(steps):
        x, y = batch(step)
        model(x, y).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms
