"""One worker of tests/test_elastic_gloo.py: the demo GPT (tiny preset) trained with sw.elastic.run on a world that
loses a worker (SIGKILL at a chosen step) and gains one. Run as a script, by the test or under `shardwise run`.

    python elastic_worker.py OUT STRATEGY STEPS KILL_LAUNCH_RANK KILL_STEP JOIN_STEP

STRATEGY: ddp, zero1, zero2 or zero3; the ZeRO ones keep a neighbour's copy of each commit (redundancy=True), so the
killed worker's shards (ZeRO-3: its parameters too) come back from memory; no checkpoint is written or read.

Environment: MASTER_ADDR / MASTER_PORT / SHARDWISE_ELASTIC=MIN:MAX (what `shardwise run --min --max` sets), RANK
(the launch rank: the one equal to KILL_LAUNCH_RANK kills itself with SIGKILL at the start of KILL_STEP's first
try, unless it is a replacement started by `shardwise run --max-restarts`). A world of 3 reaching JOIN_STEP lets
the joiner (ELASTIC_JOINER=1, started with the others; or the replacement) register and waits until it has, so that
the run goes 4 -> 3 -> 4 whatever the machine's speed. Writes OUT/timeline-<member>.json, and OUT/final.pt (rank 0's
full state dict) at the end. Every worker prints one line per epoch.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch

import shardwise as sw
from shardwise.models.gpt import GPT, GPTConfig

G, N, SEED = 12, 240, 3


def make_optimizer(params) -> torch.optim.Optimizer:
    """AdamW with eps=1e-6, as tests/parity.py explains: the attention key bias has a gradient that is zero up to
    rounding noise, which a smaller eps would turn into lr-sized steps of random sign."""
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6)


def data() -> torch.Tensor:
    return torch.randint(0, 256, (N, 33), generator=torch.Generator().manual_seed(SEED))


def build_model() -> torch.nn.Module:
    return GPT(GPTConfig.preset("tiny"), seed=SEED)


def main() -> None:
    out, strategy, steps, kill_rank, kill_step, join_step = sys.argv[1:7]
    steps, kill_rank, kill_step, join_step = int(steps), int(kill_rank), int(kill_step), int(join_step)
    tokens = data()
    launch_rank = int(os.environ.get("RANK", "-1"))
    # `shardwise run --max-restarts` replaces the killed worker by a process of the same launch rank: it must not die
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    silence = float(os.environ.get("ELASTIC_SILENCE", "1.5"))
    membership = sw.elastic.Membership.from_env(timeout=float(os.environ.get("ELASTIC_TIMEOUT", "20")), silence=silence,
                                                wait_timeout=float(os.environ.get("ELASTIC_WAIT", "20")))

    if os.environ.get("ELASTIC_JOINER"):  # started early (its imports overlap the others' training), it registers
        _wait_for_key(membership, "test/join_now")  # only once the 3 survivors reached the join step

    def build(comm):
        net = build_model()
        model = sw.DDP(net, comm) if strategy == "ddp" else sw.ZeRO(net, comm, stage=int(strategy[-1]))
        return model, make_optimizer(model.parameters())

    def train_step(ctx):
        if launch_rank == kill_rank and ctx.step == kill_step and ctx.comm.size == 4 and not restarted:
            with open(os.path.join(out, "killed.json"), "w") as f:
                json.dump({"t": time.time(), "step": ctx.step}, f)
            os.kill(os.getpid(), signal.SIGKILL)
        if ctx.comm.size == 3 and ctx.step == join_step:
            membership.store.set("test/join_now", "1")
            # The members' poll creates join/count at 0 (store.add), so its mere existence says nothing: wait for
            # the joiner's registration to count.
            _wait_until(lambda: int(membership.store.add("join/count", 0)) >= 1)
        idx = ctx.sampler.rank_indices()
        loss = ctx.model(tokens[idx, :-1], tokens[idx, 1:])
        loss.backward()
        ctx.optimizer.step()
        ctx.optimizer.zero_grad()
        return loss.item()

    sampler = sw.elastic.Sampler(N, global_batch=G, seed=SEED, world_sizes=range(3, 5))
    # ZeRO shards its optimizer moments: a lost rank's shard comes back from its neighbour's copy, not from disk
    ctx = sw.elastic.run(membership, build, train_step, sampler=sampler, steps=steps, commit_every=1,
                         redundancy=strategy != "ddp")
    state = sw.full_state_dict(ctx.model)
    if ctx.comm.rank == 0:
        torch.save(state, os.path.join(out, "final.pt"))
    with open(os.path.join(out, f"timeline-{membership.id}.json"), "w") as f:
        json.dump({"timeline": ctx.timeline, "world": ctx.comm.size, "step": ctx.step,
                   "samples": sampler.samples_seen}, f)
    membership.close()


def _wait_for_key(membership, key: str) -> None:
    """Test choreography through the job's store (at most 60 s)."""
    _wait_until(lambda: membership.store.check([key]))


def _wait_until(condition) -> None:
    deadline = time.monotonic() + 60
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)


if __name__ == "__main__":
    main()
