"""Benchmark: the transports of one host's gloo collectives, side by side, at 2 and 4 ranks.

For each world size (2 and 4 gloo processes; 4 on a 2-core machine is oversubscribed and flagged), the same
collectives of one ZeRO unit's size (--mb, default 6.8 MB of fp32, the bench GPT's Block) through every way the torch
backend can run them, alternating in the same processes (`alternate`: rounds of --steps calls each, the order
rotating), per call the slowest rank, medians:

  reduce-scatter   shm (comm/shm_channel.py; the default on one host), ring (comm/gloo_ring.py: our ring over gloo's
                   point-to-point on a scratch input; the default across hosts), allreduce_slice (gloo's in-place
                   all-reduce, then this rank's chunk), gloo (gloo's own reduce_scatter_tensor: clones the input and
                   all-reduces the clone)
  all-gather       shm, gloo
  all-reduce       shm, gloo

Every variant's result is checked against the first's (bit-identical at 2 ranks; sums of 4 may round differently).
stdout: one JSON line per (world, collective, variant) and a summary line; the table goes to stderr.

    .venv/bin/python bench/collectives.py
    .venv/bin/python bench/collectives.py --worlds 2 --mb 25
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch

import shardwise
from shardwise.comm.torch_backend import TorchCommunicator

from shardwise.benchmarks.timing import alternate, comma_list, emit, loadavg, max_over_ranks, median

AVG = shardwise.ReduceOp.AVG


def _variants(shm: Any, sockets: Any, n: int) -> tuple[dict[str, dict[str, Any]], dict[str, torch.Tensor]]:
    """{collective: {variant: call}} and {collective: the tensor its calls write}; each call copies the same."""
    full = torch.randn(n, generator=torch.Generator().manual_seed(shm.rank))
    scratch = full.clone()
    shard = torch.empty(n // shm.size)
    gathered = torch.empty(n)
    source = torch.randn(n // shm.size, generator=torch.Generator().manual_seed(10 + shm.rank))
    lo = shm.rank * (n // shm.size)

    def allreduce_slice() -> None:
        scratch.copy_(full)
        sockets.all_reduce(scratch, AVG)
        shard.copy_(scratch[lo : lo + n // shm.size])

    def ring() -> None:
        scratch.copy_(full)
        sockets.reduce_scatter(shard, scratch, AVG, scratch_input=True)

    def shm_rs() -> None:
        scratch.copy_(full)  # the same copy as the others pay, so that only the transport differs
        shm.reduce_scatter(shard, scratch, AVG, scratch_input=True)

    def gloo_rs() -> None:
        scratch.copy_(full)
        sockets.reduce_scatter(shard, scratch, AVG)

    def all_reduce(comm: Any) -> Any:
        def run() -> None:
            scratch.copy_(full)
            comm.all_reduce(scratch)
        return run

    return {
        "reduce_scatter": {"shm": shm_rs, "ring": ring, "allreduce_slice": allreduce_slice, "gloo": gloo_rs},
        "all_gather": {"shm": lambda: shm.all_gather(gathered, source),
                       "gloo": lambda: sockets.all_gather(gathered, source)},
        "all_reduce": {"shm": all_reduce(shm), "gloo": all_reduce(sockets)},
    }, {"reduce_scatter": shard, "all_gather": gathered, "all_reduce": scratch}


def _rank_main(comm: Any, n: int, rounds: int, steps: int) -> dict[str, Any]:
    sockets = TorchCommunicator(None, timeout=comm.timeout, shared_memory=False)
    calls, outputs = _variants(comm, sockets, n)
    times: dict[str, dict[str, list[float]]] = {c: {v: [] for v in vs} for c, vs in calls.items()}
    agree: dict[str, dict[str, float]] = {}
    for collective, variants in calls.items():
        first = None
        for name, call in variants.items():  # warm-up (opens the shared-memory channel), and the results compared
            call()
            call()
            if first is None:
                first = outputs[collective].clone()
            else:
                agree.setdefault(collective, {})[name] = float((outputs[collective] - first).abs().max())

        def run(item: tuple[str, Any]) -> None:
            name, call = item
            t = time.perf_counter()
            call()
            times[collective][name].append(time.perf_counter() - t)

        alternate(list(variants.items()), rounds, steps, run, comm.barrier)
    return {"times": times, "agree": agree, "shared_memory": comm.shared_memory}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="2,4", help="gloo process counts (comma list; default 2,4)")
    parser.add_argument("--mb", type=float, default=6.77, help="payload in MB of fp32 (default 6.77: one Block unit)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    cpus = os.cpu_count() or 1
    summary = []
    for world in comma_list(args.worlds, int):
        n = int(args.mb * 1024 * 1024 / 4) // world * world
        start = loadavg()
        results = shardwise.launch(_rank_main, world, n, args.rounds, args.steps, backend="gloo", threads_per_rank=1,
                                   timeout=600)
        for collective, variants in results[0]["times"].items():
            row = {}
            for name in variants:
                per_call = max_over_ranks([r["times"][collective][name] for r in results])
                row[name] = round(median(per_call) * 1e3, 2)
                emit({"world": world, "collective": collective, "variant": name, "median_ms": row[name],
                      "calls": len(per_call), "MB": round(n * 4 / 2**20, 2), "oversubscribed": world > cpus,
                      "max_abs_diff_vs_first": results[0]["agree"].get(collective, {}).get(name, 0.0)})
            summary.append((world, collective, row))
        emit({"world": world, "shared_memory": results[0]["shared_memory"], "loadavg_start": start,
              "loadavg_end": loadavg(), "cpus": cpus})
    print(f"\nOne host's gloo collectives, {args.mb} MB fp32, medians of {args.rounds} x {args.steps} alternating "
          "calls (slowest rank), ms:", file=sys.stderr)
    for world, collective, row in summary:
        flag = "  (oversubscribed: more ranks than cores)" if world > cpus else ""
        cells = ", ".join(f"{k} {v:.2f}" for k, v in sorted(row.items(), key=lambda kv: kv[1]))
        print(f"  {world} ranks  {collective:<15} {cells}{flag}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
