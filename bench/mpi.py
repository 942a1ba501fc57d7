"""Benchmark: the MPI backend against gloo, in the same processes, under mpirun.

Every world size is one `shardwise.launch(..., backend="mpi", threads_per_rank=1)`: each rank holds an MPI
Communicator and a gloo Communicator bootstrapped through MPI (`shardwise.init(backend="gloo")`), so both backends
run in the same processes and ALTERNATE (the order rotates every round), and a noisy machine slows both alike.

Collectives (rows `op`, `bytes`, per backend): all_reduce, all_gather and reduce_scatter through shardwise
Communicators, from 1 KB to 64 MB (x4 steps). `bytes` is the payload as CommStats counts it: the all-reduced tensor,
the gathered output, the unreduced input. A measurement is `iters` back-to-back calls after a barrier (iters shrinks
as the size grows); its per-call time is the max over ranks; the figure is the median over `--rounds` rounds.
`algbw` = bytes / time; `busbw` = algbw x 2(N-1)/N (all_reduce) or (N-1)/N (the others), comparable across N.
The `mpi4py` row is the floor: the same blocking call made directly with mpi4py on numpy buffers, i.e. what
shardwise's deadline polling costs on top of MPI.

DDP (rows `ddp`): shardwise.DDP over each backend, same GPT and data, `--ddp-rounds` rounds of `--ddp-steps` steps
each, alternating; step = forward + backward + AdamW step + zero_grad, max over ranks; median over measured steps.
The parity field is the max |parameter difference| between the two models after training on the same batches.

stdout carries JSON lines only; a summary table goes to stderr.

    .venv/bin/python bench/mpi.py                        # 2 and 4 ranks, everything (a few minutes)
    .venv/bin/python bench/mpi.py --nproc 2 --rounds 3 --max-bytes 4M --ddp-steps 3   # quicker
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any

import numpy as np
import torch

import shardwise
from shardwise.models.gpt import GPT, GPTConfig

from shardwise.benchmarks.timing import alternate, bench_corpus, comma_list, emit, median, rotations, step_stats

OPS = ("all_reduce", "all_gather", "reduce_scatter")
KB = 1024


@dataclasses.dataclass(frozen=True)
class Config:
    min_bytes: int
    max_bytes: int
    ops: tuple[str, ...]
    rounds: int
    target_bytes: int  # bytes moved per measurement; sets iters
    ddp_steps: int
    ddp_rounds: int
    ddp_warmup: int
    preset: str
    batch_size: int
    raw: bool


def _sizes(cfg: Config) -> list[int]:
    sizes, b = [], cfg.min_bytes
    while b <= cfg.max_bytes:
        sizes.append(b)
        b *= 4
    return sizes


def _runner(op: str, comm: Any, nbytes: int) -> Any:
    """A zero-argument callable that issues one `op` of `nbytes` payload on `comm` (a Communicator, or mpi4py's)."""
    n, size = nbytes // 4, comm.size if hasattr(comm, "size") else comm.Get_size()
    if hasattr(comm, "all_reduce"):
        if op == "all_reduce":
            t = torch.ones(n)
            return lambda: comm.all_reduce(t)
        full, chunk = torch.ones(n), torch.ones(n // size)
        if op == "all_gather":
            return lambda: comm.all_gather(full, chunk)
        return lambda: comm.reduce_scatter(chunk, full)
    from mpi4py import MPI  # the floor: mpi4py's blocking calls on numpy buffers

    full, chunk = np.ones(n, dtype=np.float32), np.ones(n // size, dtype=np.float32)
    if op == "all_reduce":
        return lambda: comm.Allreduce(MPI.IN_PLACE, full)
    if op == "all_gather":
        return lambda: comm.Allgather(chunk, full)
    return lambda: comm.Reduce_scatter_block(full, chunk)


def _max_over_ranks(comm: shardwise.Communicator, value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    comm.all_reduce(t, shardwise.ReduceOp.MAX)
    return float(t.item())


def _collectives(comm: shardwise.Communicator, peers: dict[str, Any], cfg: Config) -> list[dict]:
    rows = []
    for op in cfg.ops:
        for nbytes in _sizes(cfg):
            iters = max(2, min(200, cfg.target_bytes // nbytes))
            calls = {name: _runner(op, c, nbytes) for name, c in peers.items()}
            for call in calls.values():  # warm-up: connections, buffers, algorithm selection
                call()
                call()
            times: dict[str, list[float]] = {name: [] for name in calls}
            for order in rotations(list(calls), cfg.rounds):
                for name in order:
                    comm.barrier()
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        calls[name]()
                    times[name].append(_max_over_ranks(comm, (time.perf_counter() - t0) / iters))
            for name, ts in times.items():
                rows.append({"op": op, "bytes": nbytes, "backend": name, "iters": iters,
                             "median_us": median(ts) * 1e6, "min_us": min(ts) * 1e6})
    return rows


def _ddp(comm: shardwise.Communicator, peers: dict[str, shardwise.Communicator], cfg: Config) -> dict:
    mcfg = GPTConfig.preset(cfg.preset)
    corpus = bench_corpus()
    models = {name: shardwise.DDP(GPT(mcfg, seed=0), c) for name, c in peers.items()}
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}
    step_no = dict.fromkeys(models, 0)
    times: dict[str, list[float]] = {name: [] for name in models}

    def step(name: str) -> float:
        x, y = corpus.batch(step_no[name], cfg.batch_size, mcfg.seq_len, rank=comm.rank, world_size=comm.size)
        step_no[name] += 1
        t0 = time.perf_counter()
        models[name](x, y).backward()
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    for name in models:
        for _ in range(cfg.ddp_warmup):
            step(name)
    alternate(list(models), cfg.ddp_rounds, cfg.ddp_steps,
              lambda name: times[name].append(_max_over_ranks(comm, step(name))), comm.barrier)
    a, b = (list(m.parameters()) for m in models.values())
    parity = max((p - q).abs().max().item() for p, q in zip(a, b))
    return {"times": times, "parity": parity, "params": sum(p.numel() for p in a)}


def _rank_main(comm: shardwise.Communicator, cfg: Config) -> dict:
    gloo = shardwise.init(backend="gloo", timeout=300)  # bootstrapped through MPI: same processes, both backends
    peers: dict[str, Any] = {"mpi": comm, "gloo": gloo}
    result: dict[str, Any] = {}
    if cfg.ops:
        if cfg.raw:
            from mpi4py import MPI

            peers["mpi4py"] = MPI.COMM_WORLD
        result["collectives"] = _collectives(comm, peers, cfg)
    if cfg.ddp_steps:
        result["ddp"] = _ddp(comm, {"mpi": comm, "gloo": gloo}, cfg)
    return result if comm.rank == 0 else {}


def _bytes(text: str) -> int:
    units = {"K": KB, "M": KB * KB}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def _human(n: int) -> str:
    return f"{n // (KB * KB)} MB" if n >= KB * KB else f"{n // KB} KB"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", default="2,4", help="comma list of world sizes (one mpirun each)")
    p.add_argument("--min-bytes", default="1K")
    p.add_argument("--max-bytes", default="64M")
    p.add_argument("--ops", default=",".join(OPS), help="comma list; empty for DDP only")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--target-bytes", default="32M", help="payload per measurement (sets iterations per size)")
    p.add_argument("--no-raw", action="store_true", help="drop the mpi4py floor rows")
    p.add_argument("--ddp-steps", type=int, default=5, help="steps per backend per round; 0 skips DDP")
    p.add_argument("--ddp-rounds", type=int, default=4)
    p.add_argument("--ddp-warmup", type=int, default=2)
    p.add_argument("--preset", default="bench", help="GPT preset for the DDP rows (tiny | small | bench)")
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    a = p.parse_args(argv)
    cfg = Config(_bytes(a.min_bytes), _bytes(a.max_bytes), tuple(comma_list(a.ops)), a.rounds,
                 _bytes(a.target_bytes), a.ddp_steps, a.ddp_rounds, a.ddp_warmup, a.preset, a.batch_size, not a.no_raw)
    for n in comma_list(a.nproc, int):
        start = time.monotonic()
        result = shardwise.launch(_rank_main, n, cfg, backend="mpi", timeout=300, threads_per_rank=1)[0]
        wall = time.monotonic() - start
        bus = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n}
        rows = result.get("collectives", [])
        for row in rows:
            algbw = row["bytes"] / (row["median_us"] * 1e-6) / 1e9
            row.update(nproc=n, algbw_gbs=round(algbw, 3), busbw_gbs=round(algbw * bus[row["op"]], 3),
                       median_us=round(row["median_us"], 1), min_us=round(row["min_us"], 1))
            emit(row)
        print(f"\n{n} ranks (launch {wall:.0f}s): median us per call [busbw GB/s]", file=sys.stderr)
        backends = list(dict.fromkeys(r["backend"] for r in rows))
        for op in cfg.ops:
            print(f"  {op:<15}" + "".join(f"{b:>22}" for b in backends) + "   gloo/mpi", file=sys.stderr)
            for nbytes in _sizes(cfg):
                cell = {r["backend"]: r for r in rows if r["op"] == op and r["bytes"] == nbytes}
                text = "".join(f"{cell[b]['median_us']:>12.1f} [{cell[b]['busbw_gbs']:6.2f}]" for b in backends)
                print(f"  {_human(nbytes):<15}{text}   {cell['gloo']['median_us'] / cell['mpi']['median_us']:8.2f}",
                      file=sys.stderr)
        if "ddp" in result:
            ddp = result["ddp"]
            medians = {name: median(ts) * 1e3 for name, ts in ddp["times"].items()}
            for name, ts in ddp["times"].items():
                emit({"op": "ddp", "nproc": n, "backend": name, "preset": cfg.preset, "batch_per_rank": cfg.batch_size,
                      **step_stats(ts)})
            ratio = medians["mpi"] / medians["gloo"]
            emit({"op": "ddp_ratio", "nproc": n, "mpi_over_gloo": round(ratio, 3), "parity_max_abs_diff": ddp["parity"],
                  "params": ddp["params"]})
            print(f"  DDP ({cfg.preset}, {ddp['params'] / 1e6:.1f}M params, batch {cfg.batch_size}/rank): "
                  + ", ".join(f"{k} {v:.0f} ms" for k, v in medians.items())
                  + f"; mpi/gloo {medians['mpi'] / medians['gloo']:.2f}; parity {ddp['parity']:.1e}", file=sys.stderr)


if __name__ == "__main__":
    main()
