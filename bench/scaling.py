"""Benchmark: how ZeRO-1/2/3 scale with the number of ranks, against the ZeRO paper's formulas and the compute floor.

Two tables in one run.

1. **Model states and bytes on the wire** at 2, 4, 8, 16, 32 and 64 thread ranks (`--worlds`), for ZeRO-1, -2 and -3
   in two precisions: fp32 AdamW (what the parity tests train) and mixed precision (bf16 parameters and bf16
   gradient reductions, fp32 master weights and Adam moments: the ZeRO paper's K = 12 setting). Per rank, after one
   step (backward and optimizer step, before zero_grad): `sw.memory_stats(model, opt).model_states`, and the bytes
   this rank's collectives put on the wire in one step (`comm.stats`, ring formulas). Each is printed beside its
   formula, computed from the unit layout (psi = padded parameters; N = ranks):

   | stage | model states, mixed (paper) | model states, fp32 | wire bytes per rank per step |
   |---|---|---|---|
   | ZeRO-1 | 4 psi + 12 psi/N (ours: + 4 psi/N, see below) | 8 psi + 8 psi/N | 2 (N-1)/N psi b |
   | ZeRO-2 | 2 psi + 14 psi/N (ours: + 2 psi/N, see below) | 4 psi + 12 psi/N | 2 (N-1)/N psi b |
   | ZeRO-3 | 16 psi/N | 16 psi/N | 3 (N-1)/N psi b minus the root and last unit's backward gathers |

   (b: bytes per element of the collective's dtype; ZeRO-1 holds the whole gradient buffer, ZeRO-2 the parameters.)
   In mixed precision the optimizer (any torch.optim optimizer over the fp32 master shards) needs fp32 gradients, so
   the reduced bf16 shard is upcast once into an fp32 `.grad` of the shard: 4 psi/N where the paper counts 2 psi/N of
   fp16 gradients (ZeRO-2), or nothing beyond the full buffer (ZeRO-1): the table shows the paper's formula and
   ours, and the measurement is held to ours. Thread ranks share one process, so this
   table is exact bytes, not time.

2. **Step time at 1, 2 and 4 gloo processes** (`--nprocs`) with the per-rank batch fixed (weak scaling), ZeRO-1/2/3
   and the no-communication floor (`local`: the plain model, every rank its own replica) alternating in the same
   processes (`--rounds` x `--steps`, order rotating), max over ranks per step, medians. More processes than cores
   are flagged `oversubscribed`: their step time measures CPU sharing as much as the library.

stdout: JSON lines (one per table row, then a summary); stderr: the two tables for humans.

    .venv/bin/python bench/scaling.py                      # both tables (a few minutes on 2 cores)
    .venv/bin/python bench/scaling.py --nprocs ''          # only the exact bytes table
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any

import torch

import shardwise
from shardwise.models.gpt import GPT, Block

from shardwise.benchmarks.timing import (alternate, bench_corpus, comma_list, emit, gpt_config, loadavg, max_over_ranks,
                     step_stats)

STAGES = (1, 2, 3)
PRECISIONS = {"fp32": None, "mixed": shardwise.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)}


@dataclasses.dataclass(frozen=True)
class Config:
    preset: str
    worlds: tuple[int, ...]
    nprocs: tuple[int, ...]
    batch_size: int
    steps: int
    rounds: int
    warmup: int
    lr: float = 1e-3
    seed: int = 0


# ---- table 1: exact bytes on thread ranks ---------------------------------------------------------------------------
def _formula(stage: int, precision: str, psi: int, n: int, root: int, last: int) -> dict[str, float]:
    """Model-state bytes per rank (the paper's and ours) and wire bytes per rank per step, from the layout."""
    b = 2 if precision == "mixed" else 4  # bytes per element of the gathers and reductions
    if precision == "mixed":
        paper = {1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[stage]
        ours = {1: 4 * psi + 16 * psi / n, 2: 2 * psi + 16 * psi / n, 3: 16 * psi / n}[stage]
    else:
        paper = ours = {1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}[stage]
    # ZeRO-3: forward + backward; the root unit and the last forward unit stay gathered into backward.
    gathered = psi if stage < 3 else 2 * psi - root - last
    wire = (n - 1) * (psi + gathered) * b / n
    return {"paper": paper, "ours": ours, "wire": wire}


def _bytes_rank(comm: shardwise.Communicator, cfg: Config, stage: int, precision: str) -> dict[str, Any]:
    model = shardwise.ZeRO(GPT(gpt_config(cfg.preset), seed=cfg.seed), comm, stage=stage, wrap=Block,
                           mixed_precision=PRECISIONS[precision])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    corpus = bench_corpus()
    seq = gpt_config(cfg.preset).seq_len
    for step in range(2):  # from the 2nd step on, ZeRO-1/2's post-step all-gather is part of every step
        x, y = corpus.batch(step, 2, seq, rank=comm.rank, world_size=comm.size)
        with comm.stats.measure() as moved:
            model(x, y).backward()
            opt.step()
            if step == 1:
                stats = shardwise.memory_stats(model, opt)
            opt.zero_grad(set_to_none=True)
    units = model.sharding_units()
    return {"model_states": stats.model_states, "optimizer": stats.optimizer, "wire": moved.wire_bytes(),
            "psi": sum(u["padded"] for u in units), "root": units[-1]["padded"],
            "last": units[-2]["padded"]}  # the Blocks' units are made in forward order, the root unit last


def bytes_table(cfg: Config) -> list[dict[str, Any]]:
    rows = []
    for precision in PRECISIONS:
        for stage in STAGES:
            for n in cfg.worlds:
                per_rank = shardwise.launch(_bytes_rank, n, cfg, stage, precision)
                worst = max(per_rank, key=lambda r: r["model_states"])
                f = _formula(stage, precision, worst["psi"], n, worst["root"], worst["last"])
                # AdamW keeps one `step` scalar per tensor besides its moments: not a per-parameter byte.
                scalars = worst["optimizer"] - (8 * worst["psi"] // n if stage else 0)
                measured = worst["model_states"]
                row = {"table": "bytes", "precision": precision, "stage": stage, "ranks": n, "psi": worst["psi"],
                       "model_states": measured, "formula_paper": round(f["paper"]), "formula_ours": round(f["ours"]),
                       "model_states_over_ours": round(measured / f["ours"], 4),
                       "model_states_over_paper": round(measured / f["paper"], 4),
                       "adam_step_scalar_bytes": scalars,
                       "wire_bytes": max(r["wire"] for r in per_rank), "wire_formula": round(f["wire"]),
                       "wire_over_formula": round(max(r["wire"] for r in per_rank) / f["wire"], 4)}
                rows.append(row)
                emit(row)
    return rows


# ---- table 2: step time on gloo processes ---------------------------------------------------------------------------
def _timed_rank(comm: shardwise.Communicator, cfg: Config) -> dict[str, Any]:
    torch.set_num_threads(1)
    corpus = bench_corpus()
    seq = gpt_config(cfg.preset).seq_len
    impls: dict[str, Any] = {}
    for stage in STAGES:
        model = shardwise.ZeRO(GPT(gpt_config(cfg.preset), seed=cfg.seed), comm, stage=stage, wrap=Block)
        impls[f"zero{stage}"] = (model, torch.optim.AdamW(model.parameters(), lr=cfg.lr))
    local = GPT(gpt_config(cfg.preset), seed=cfg.seed)
    impls["local"] = (local, torch.optim.AdamW(local.parameters(), lr=cfg.lr))
    steps = {name: 0 for name in impls}
    times: dict[str, list[float]] = {name: [] for name in impls}

    def step(name: str, record: bool = True) -> None:
        model, opt = impls[name]
        x, y = corpus.batch(steps[name], cfg.batch_size, seq, rank=comm.rank, world_size=comm.size)
        steps[name] += 1
        t = time.perf_counter()
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if record:
            times[name].append(time.perf_counter() - t)

    for name in impls:
        for _ in range(cfg.warmup):
            step(name, record=False)
    alternate(list(impls), cfg.rounds, cfg.steps, step, comm.barrier)
    return times


def time_table(cfg: Config) -> list[dict[str, Any]]:
    rows = []
    cores = len(os.sched_getaffinity(0))
    for n in cfg.nprocs:
        results = shardwise.launch(_timed_rank, n, cfg, backend="gloo", threads_per_rank=1, timeout=1800)
        local = step_stats(max_over_ranks([r["local"] for r in results]))["median_ms"]
        for name in results[0]:
            stats = step_stats(max_over_ranks([r[name] for r in results]))
            row = {"table": "time", "impl": name, "nproc": n, **stats, "over_local": round(stats["median_ms"] / local, 3),
                   "per_rank_batch": cfg.batch_size, "oversubscribed": n > cores, "cores": cores,
                   "loadavg": loadavg()}
            rows.append(row)
            emit(row)
    return rows


def _print(bytes_rows: list[dict[str, Any]], time_rows: list[dict[str, Any]], cfg: Config) -> None:
    err = sys.stderr
    if bytes_rows:
        print(f"\nModel states per rank (MB; measured / ours / paper) and wire bytes per rank per step (MB; measured / "
              f"formula), GPT preset {cfg.preset!r}, thread ranks:", file=err)
        for r in bytes_rows:
            print(f"  {r['precision']:5} ZeRO-{r['stage']} N={r['ranks']:3d}: states {r['model_states'] / 1e6:8.3f} / "
                  f"{r['formula_ours'] / 1e6:8.3f} / {r['formula_paper'] / 1e6:8.3f} ({r['model_states_over_ours']:.4f}"
                  f"x ours)   wire {r['wire_bytes'] / 1e6:7.3f} / {r['wire_formula'] / 1e6:7.3f}", file=err)
    if time_rows:
        print(f"\nStep time (median ms, max over ranks), per-rank batch {cfg.batch_size}, gloo, 1 thread per rank:",
              file=err)
        for r in time_rows:
            flag = "  OVERSUBSCRIBED" if r["oversubscribed"] else ""
            print(f"  N={r['nproc']} {r['impl']:6} {r['median_ms']:8.1f} ms (p10 {r['p10_ms']:.1f}, p90 {r['p90_ms']:.1f})"
                  f"  {r['over_local']:.3f}x local{flag}", file=err)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", default="tiny", help="GPT preset of both tables (default tiny)")
    ap.add_argument("--worlds", default="2,4,8,16,32,64", help="thread-rank counts of the bytes table")
    ap.add_argument("--nprocs", default="1,2,4", help="gloo process counts of the step-time table ('' for none)")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step (fixed as N grows)")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per implementation per round")
    ap.add_argument("--rounds", type=int, default=5, help="alternation rounds")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps of each implementation first")
    args = ap.parse_args(argv)
    worlds = tuple(comma_list(args.worlds, int))
    nprocs = tuple(comma_list(args.nprocs, int))
    if any(n < 1 for n in worlds + nprocs) or min(args.batch_size, args.steps, args.rounds) < 1:
        ap.error("--worlds/--nprocs entries, --batch-size, --steps and --rounds must be >= 1")
    cfg = Config(args.preset, worlds, nprocs, args.batch_size, args.steps, args.rounds, max(args.warmup, 0))
    t0 = time.time()
    bytes_rows = bytes_table(cfg)
    time_rows = time_table(cfg)
    worst = max((abs(r["model_states_over_ours"] - 1) for r in bytes_rows), default=0.0)
    wire = max((abs(r["wire_over_formula"] - 1) for r in bytes_rows), default=0.0)
    emit({"summary": {"model_states_max_rel_dev_from_formula": round(worst, 4),
                      "wire_max_rel_dev_from_formula": round(wire, 4), "wall_s": round(time.time() - t0, 1),
                      "loadavg": loadavg()}})
    _print(bytes_rows, time_rows, cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
