"""A nanoGPT-style training loop that switches between torch DDP and shardwise by one line (`wrap`).

    python examples/nanogpt_style.py --wrap zero3                      # 2 gloo ranks, started here
    python examples/nanogpt_style.py --wrap torch_ddp --ranks 2 --out runs/nanogpt
    python examples/nanogpt_style.py --wrap zero3 --resume --out runs/nanogpt   # continue from its checkpoint
    shardwise run -n 2 examples/nanogpt_style.py --wrap sw_ddp        # under a launcher (or torchrun)

The shape of Karpathy's nanoGPT `train.py`, a loop many people start from: weight-decay groups chosen by
`p.dim() >= 2`, a parameter count for MFU, gradient accumulation that synchronises only on the last micro-batch
(`model.require_backward_grad_sync`), a loss scaler, clipping, a cosine learning rate, evaluation every
`--eval-interval` steps, and a checkpoint (model, optimizer, step) that resumes exactly. Everything but `wrap` is
the same for all four variants, and they log the same losses (tests/test_nanogpt_example.py checks that, and the
exact resume). What the loop uses from shardwise, and why each is right under every wrapper:

* `model.module` is the model itself under shardwise's wrappers (they wrap in place), torch DDP's inner module.
* `p.dim()` and `p.numel()` answer for the whole parameter under ZeRO-3 (`ShardedParameter`), so the decay groups
  and the parameter count are one process's.
* torch's own `clip_grad_norm_` and `GradScaler` run as they are: under ZeRO-3 a piece's norm is its whole tensor's
  and an overflow in any rank's piece skips the step on every rank (`sw.clip_grad_norm_(model, 1.0)` and
  `sw.ShardedGradScaler(model)` do the same, and also cover pipelines and gradient compression).
* Evaluation runs on every rank: a ZeRO-3 forward gathers parameters, a collective every rank must join.
* The checkpoint: `sw.full_state_dict` and `sw.full_optimizer_state_dict` (collective: every rank calls them, rank 0
  saves) give one process's state dicts; torch's `load_state_dict` of both slices them into any layout.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from typing import Any

import torch

import shardwise as sw
from shardwise.models import GPT, GPTConfig

WRAPS = ("torch_ddp", "sw_ddp", "zero3", "distribute")


def wrap(model: torch.nn.Module, comm: sw.Communicator, how: str) -> torch.nn.Module:
    """The one line a user changes."""
    if how == "torch_ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if how == "sw_ddp":
        return sw.DDP(model, comm)
    if how == "zero3":
        return sw.ZeRO(model, comm, stage=3)
    return sw.distribute(model, comm)


def configure_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """nanoGPT's groups: matrices and embeddings decay, biases and norms do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def get_batch(args: argparse.Namespace, cfg: GPTConfig, step: int, micro: int, rank: int, world: int):
    """Micro-batch `micro` of step `step`: this rank's rows of a global batch the same for every world size.
    Each row counts up from a random token by a random stride (mod the vocabulary): learnable in a few steps."""
    g = torch.Generator().manual_seed(1_000_003 * step + micro)
    rows = args.batch_size * world
    first = torch.randint(0, cfg.vocab_size, (rows, 1), generator=g)
    stride = torch.randint(1, 4, (rows, 1), generator=g)
    idx = (first + stride * torch.arange(cfg.seq_len + 1)) % cfg.vocab_size
    rows = idx[rank * args.batch_size:(rank + 1) * args.batch_size]
    return rows[:, :-1], rows[:, 1:]


@torch.no_grad()
def estimate_loss(model: torch.nn.Module, args: argparse.Namespace, cfg: GPTConfig) -> float:
    """The mean loss over fixed evaluation batches (the same on every rank; every rank runs it)."""
    model.eval()
    losses = [float(model(*get_batch(args, cfg, -1 - k, 0, 0, 1))) for k in range(args.eval_iters)]
    model.train()
    return sum(losses) / len(losses)


def get_lr(step: int, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine decay to lr / 10 (nanoGPT's schedule)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    ratio = min(1.0, (step - args.warmup) / max(1, args.max_iters - args.warmup))
    return args.lr / 10 + 0.5 * (1 + math.cos(math.pi * ratio)) * (args.lr - args.lr / 10)


def train(comm: sw.Communicator, args: argparse.Namespace) -> dict[str, Any]:
    """The loop; returns rank's log ({step: train loss}, {step: eval loss}) and the final full state dict."""
    master = comm.rank == 0
    cfg = GPTConfig.preset("tiny", dropout=0.0)
    model = wrap(GPT(cfg, seed=0), comm, args.wrap)
    raw_model = model.module
    optimizer = configure_optimizer(raw_model, args.lr, args.weight_decay)
    scaler = torch.amp.GradScaler(enabled=False)  # enabled=True with fp16 autocast on a GPU
    path = os.path.join(args.out, f"ckpt-{args.wrap}.pt")
    start = 0
    if args.resume:
        checkpoint = torch.load(path, weights_only=True)
        raw_model.load_state_dict(checkpoint["model"])  # a full state dict, sliced to this rank's pieces
        optimizer.load_state_dict(checkpoint["optimizer"])
        start = checkpoint["iter_num"]
    n_params = sum(p.numel() for p in raw_model.parameters())
    forward = torch.compile(model) if args.compile else model  # compile the wrapped model (wrap first)
    tokens_per_step = args.batch_size * comm.size * args.accum * cfg.seq_len
    train_log: dict[int, float] = {}
    eval_log: dict[int, float] = {}
    for step in range(start, args.max_iters):
        for group in optimizer.param_groups:
            group["lr"] = get_lr(step, args)
        if step % args.eval_interval == 0:
            eval_log[step] = estimate_loss(forward, args, cfg)
            checkpoint = {"model": sw.full_state_dict(raw_model),  # collective: every rank calls, rank 0 saves
                          "optimizer": sw.full_optimizer_state_dict(raw_model, optimizer), "iter_num": step}
            if master and step > start:
                os.makedirs(args.out, exist_ok=True)
                torch.save(checkpoint, path + ".tmp")
                os.replace(path + ".tmp", path)
            comm.barrier()
        t0 = time.perf_counter()
        for micro in range(args.accum):
            model.require_backward_grad_sync = micro == args.accum - 1  # reduce once, on the last micro-batch
            loss = forward(*get_batch(args, cfg, step, micro, comm.rank, comm.size)) / args.accum
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        train_log[step] = float(loss.detach()) * args.accum
        if master and step % args.log_every == 0:
            dt = time.perf_counter() - t0
            flops = 6 * n_params * tokens_per_step / dt
            print(f"step {step}: loss {train_log[step]:.4f}, {dt * 1e3:.0f} ms, {n_params:,} params, "
                  f"{flops / 1e9:.2f} GFLOP/s (MFU: divide by your device's peak)", flush=True)
    return {"train": train_log, "eval": eval_log, "state": sw.full_state_dict(raw_model), "n_params": n_params}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wrap", choices=WRAPS, default="zero3")
    p.add_argument("--ranks", type=int, default=2, help="gloo ranks to start when not under a launcher")
    p.add_argument("--max-iters", type=int, default=20)
    p.add_argument("--eval-interval", type=int, default=5)
    p.add_argument("--eval-iters", type=int, default=2)
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank per micro-batch")
    p.add_argument("--accum", type=int, default=2, help="micro-batches per step (gradient accumulation)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default="runs/nanogpt_style")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--compile", action="store_true", help="torch.compile the wrapped model")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "WORLD_SIZE" in os.environ or "OMPI_COMM_WORLD_SIZE" in os.environ:  # under a launcher: this is one rank
        train(sw.init(), args)
    else:
        sw.launch(train, args.ranks, args, backend="gloo", timeout=300)


if __name__ == "__main__":
    main()
