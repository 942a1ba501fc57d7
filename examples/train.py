"""Train the small byte-level GPT data-parallel: the script a user writes, launched by any launcher.

    shardwise run -n 2 examples/train.py --steps 100            # shardwise's own supervised launcher
    shardwise run -n 4 examples/train.py --strategy zero3        # ZeRO-3: parameters, gradients, Adam state sharded
    torchrun --nproc-per-node 2 examples/train.py                # the same script under torchrun
    python examples/train.py --steps 20                          # one process (sw.init() gives a world of one)

Every rank builds the same model (seeded), wraps it with the chosen strategy and trains on its own slice of each
global batch (`ShardedSampler`: rank r takes rows [r*B, (r+1)*B) of the step's B*N windows, so N ranks see exactly
the batch one process would with B*N rows). Rank 0 logs the loss averaged over the ranks and the global tokens/s every
--log-every steps through `sw.get_logger`, so you see it train. The corpus is the Python standard library's own
sources (`ByteCorpus()`, bytes as tokens: nothing to download), or --data FILE_OR_FOLDER.
"""

from __future__ import annotations

import argparse
import time

import torch

import shardwise as sw
from shardwise.data import ByteCorpus, ShardedSampler
from shardwise.models import GPT, GPTConfig

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (default: %(default)s)")
    p.add_argument("--strategy", choices=STRATEGIES, default="ddp", help="data-parallel strategy (default: ddp)")
    p.add_argument("--preset", choices=("tiny", "small", "bench"), default="small", help="GPT size (default: small)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default: %(default)s)")
    p.add_argument("--log-every", type=int, default=10, help="log every N steps (default: %(default)s)")
    p.add_argument("--data", default=None, help="text file or folder (default: the Python standard library)")
    p.add_argument("--seed", type=int, default=0, help="model init and data order (default: %(default)s)")
    return p.parse_args()


def wrap(model: torch.nn.Module, comm: sw.Communicator, strategy: str) -> torch.nn.Module:
    """The distributed module; it trains with the same plain loop whichever strategy wraps it."""
    if strategy == "ddp":
        return sw.DDP(model, comm)
    if strategy == "fsdp":
        return sw.FSDP(model, comm, sharding="full_shard")
    return sw.ZeRO(model, comm, stage=int(strategy[-1]))


def main() -> None:
    args = parse_args()
    comm = sw.init()  # RANK / WORLD_SIZE / MASTER_ADDR from shardwise run, torchrun, mpirun or srun
    log = sw.get_logger("shardwise.train")  # `[rank 0] INFO shardwise.train: ...` on stderr
    config = GPTConfig.preset(args.preset)
    model = GPT(config, seed=args.seed)  # the same initial weights on every rank
    n_params = sum(p.numel() for p in model.parameters())  # counted before sharding strategies split them
    model = wrap(model, comm, args.strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    corpus = ByteCorpus(args.data)
    batches = ShardedSampler(corpus, args.batch_size, config.seq_len, rank=comm.rank, world_size=comm.size,
                             seed=args.seed)
    if comm.rank == 0:
        log.info("training a %s GPT (%.2fM parameters) with %s on %d rank(s), %s", args.preset,
                 n_params / 1e6, args.strategy, comm.size, corpus.source)
    tokens_per_step = args.batch_size * comm.size * config.seq_len
    start, since = time.perf_counter(), 0
    for step in range(1, args.steps + 1):
        x, y = next(batches)
        loss = model(x, y)
        loss.backward()
        sw.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
        since += 1
        if step % args.log_every == 0 or step == args.steps:
            mean = loss.detach().clone()
            comm.all_reduce(mean, sw.ReduceOp.AVG)  # the loss of the whole global batch, not rank 0's slice
            elapsed = time.perf_counter() - start
            if comm.rank == 0:
                log.info("step %d/%d  loss %.4f  %.0f tokens/s", step, args.steps, mean.item(),
                         since * tokens_per_step / elapsed)
            start, since = time.perf_counter(), 0


if __name__ == "__main__":
    main()
