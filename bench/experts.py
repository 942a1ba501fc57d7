"""Benchmark: expert parallelism (ep = 2, 4) on thread ranks: all-to-all bytes per step against the formula of
docs/experts.md, and step time dropless vs a capacity factor, with one process and a no-communication floor as peers.

A small MoE GPT (``--d-model`` 64, 4 heads, 2 layers, ``--seq-len`` 64, 8 experts, k = 2, auxiliary loss 0.01,
AdamW) trains on ``shardwise.launch(fn, ep)`` thread ranks (ep == dp: every rank holds E / ep experts and its own
``--batch-size`` sequences of the global batch of ep x batch-size). Rows, all in the SAME run and ALTERNATING
(after warm-up, ``--rounds`` rounds of ``--steps`` steps of each row, the order rotating every round; per step the
slowest rank; medians):

* ``dropless``: ``sw.DDP(expert_parallel(GPT(config), comm), comm)``, capacity_factor None: every step equals one
  process's step on the global batch (the parity line checks the losses).
* ``cf<x>``: the same with ``capacity_factor=x`` (``--capacity-factor``, 1.25): each expert takes at most
  ceil(x N k / E) of a rank's assignments; the rest are dropped. Prints the dropped fraction.
* ``one_process``: the plain MoE GPT (all experts, no wrapper) on the whole global batch, run by rank 0 alone while
  the other ranks wait: the step expert parallelism replaces.
* ``no_comm_floor``: every rank runs the plain MoE GPT (all experts, no communication) on its own part of the batch:
  about the same arithmetic per rank as the ``dropless`` row, what it would cost if the all-to-alls, the balance
  all-reduces and DDP were free.

Bytes. Around every measured step of the expert-parallel rows, ``comm.stats.measure()`` counts the all-to-all
payload (the total input of each call, CommStats' convention) on each rank. Summed over the ep ranks, per step::

    formula = n_layers x (ep x 8 E) + 16 d x sum over layers (N k - dropped)

(docs/experts.md, "Mechanism": per layer one all-to-all of the (ep, E/ep) int64 counts on each rank, and four of
rows of d fp32 values, each rank sending its kept assignments twice and the rows its experts received twice; the
received rows of the group sum to its sent rows). N is the group's tokens per step. The bytes line prints the
measured and formula bytes per rank and step (group sum / ep), their ratio (1.0 expected), and the wire bytes (what
left each rank: its own share excluded) against (ep-1)/ep x payload, which holds only on average for uniform
routing.

Threads: every rank runs with one intra-op thread (``torch.set_num_threads(1)``, process-wide), on a 2-core
machine; ``one_process`` also uses one thread for ep x the work of a rank. stdout carries JSON lines only (a config
line with the load average, per ep one line per row, a bytes line per expert-parallel row, a parity line and a
ratio line, and the load average at the end); the summary goes to stderr.

    .venv/bin/python bench/experts.py                            # ep 2 and 4, 5 rounds x 5 steps
    .venv/bin/python bench/experts.py --ep 2 --rounds 7 --steps 3
    .venv/bin/python bench/experts.py --quick                    # smoke run (tiny sizes, a few seconds)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from typing import Any

import torch

import shardwise as sw
from shardwise.data import ByteCorpus
from shardwise.experts import expert_parallel
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.models.moe import MoE

from shardwise.benchmarks.timing import (alternate, bench_corpus, comma_list, emit, loadavg, max_over_ranks, median, per_round_ratios,
                     step_stats)

COUNT_BYTES = 8  # the counts travel as int64
ROW_BYTES = 4  # rows of d fp32 values


@dataclasses.dataclass(frozen=True)
class Config:
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    seq_len: int = 64
    n_experts: int = 8
    top_k: int = 2
    batch_size: int = 8  # sequences per rank
    capacity_factor: float = 1.25
    steps: int = 5
    rounds: int = 5
    warmup: int = 2
    lr: float = 1e-3
    seed: int = 0

    def model(self) -> GPTConfig:
        return GPTConfig(vocab_size=256, seq_len=self.seq_len, d_model=self.d_model, n_heads=self.n_heads,
                         n_layers=self.n_layers, n_experts=self.n_experts, experts_per_token=self.top_k,
                         moe_aux_loss_coef=0.01)

    def formula_bytes(self, ep: int, tokens: int, dropped: int) -> int:
        """All-to-all payload of one step summed over the ep ranks; `tokens` the group's, `dropped` over layers."""
        counts = self.n_layers * ep * COUNT_BYTES * self.n_experts
        rows = 4 * ROW_BYTES * self.d_model * (self.n_layers * tokens * self.top_k - dropped)
        return counts + rows


class _Row:
    def __init__(self, name: str, model: torch.nn.Module, cfg: Config, *, everyone: bool, global_batch: bool) -> None:
        self.name, self.model = name, model
        self.layers = [m for m in model.modules() if isinstance(m, MoE)]
        self.opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        self.everyone, self.global_batch = everyone, global_batch
        self.step_no = 0
        self.times: list[float] = []
        self.losses: list[float] = []
        self.bytes: list[tuple[int, int, int]] = []  # per measured step: payload, wire, dropped (all layers)


def _step(row: _Row, comm: sw.Communicator, corpus: ByteCorpus, cfg: Config, measured: bool) -> None:
    if not row.everyone and comm.rank != 0:
        if measured:
            row.times.append(0.0)  # the max over ranks is rank 0's time
        return
    if row.global_batch:
        x, y = corpus.batch(row.step_no, cfg.batch_size * comm.size, cfg.seq_len, seed=cfg.seed)
    else:
        x, y = corpus.batch(row.step_no, cfg.batch_size, cfg.seq_len, seed=cfg.seed, rank=comm.rank,
                            world_size=comm.size)
    row.step_no += 1
    t0 = time.perf_counter()
    with comm.stats.measure() as counted:
        loss = row.model(x, y)
        loss.backward()
        row.opt.step()
        row.opt.zero_grad(set_to_none=True)
    elapsed = time.perf_counter() - t0
    if measured:
        row.times.append(elapsed)
        row.losses.append(loss.item())
        dropped = sum(int(m.stats["dropped"]) for m in row.layers)
        row.bytes.append((counted.bytes("all_to_all"), counted.wire_bytes("all_to_all"), dropped))


def _rank_main(comm: sw.Communicator, cfg: Config, corpus: ByteCorpus) -> dict[str, Any]:
    mcfg = cfg.model()
    ep_rows = [
        _Row("dropless", sw.DDP(expert_parallel(GPT(mcfg, seed=cfg.seed), comm), comm), cfg, everyone=True,
             global_batch=False),
        _Row(f"cf{cfg.capacity_factor:g}", sw.DDP(expert_parallel(GPT(mcfg, seed=cfg.seed), comm,
                                                                   capacity_factor=cfg.capacity_factor), comm),
             cfg, everyone=True, global_batch=False),
    ]
    rows = ep_rows + [
        _Row("one_process", GPT(mcfg, seed=cfg.seed), cfg, everyone=False, global_batch=True),
        _Row("no_comm_floor", GPT(mcfg, seed=cfg.seed), cfg, everyone=True, global_batch=False),
    ]
    for row in rows:
        comm.barrier()
        for _ in range(cfg.warmup):
            _step(row, comm, corpus, cfg, measured=False)
    alternate(rows, cfg.rounds, cfg.steps, lambda row: _step(row, comm, corpus, cfg, measured=True), comm.barrier)
    return {"times": {r.name: r.times for r in rows}, "losses": {r.name: r.losses for r in rows},
            "bytes": {r.name: r.bytes for r in ep_rows},
            "capacity": ep_rows[1].layers[0].stats["capacity"], "trained_steps": rows[0].step_no}


def _bytes_line(cfg: Config, ep: int, name: str, per_rank: list[list[tuple[int, int, int]]]) -> dict[str, Any]:
    tokens = ep * cfg.batch_size * cfg.seq_len  # the group's tokens per step
    payload = wire = formula = dropped_total = 0
    exact = True
    for step in zip(*per_rank):  # per step: every rank's (payload, wire, dropped)
        step_payload, step_dropped = sum(s[0] for s in step), sum(s[2] for s in step)
        step_formula = cfg.formula_bytes(ep, tokens, step_dropped)
        exact &= step_payload == step_formula
        payload, wire, formula = payload + step_payload, wire + sum(s[1] for s in step), formula + step_formula
        dropped_total += step_dropped
    steps = len(per_rank[0])
    assignments = steps * cfg.n_layers * tokens * cfg.top_k
    return {"bytes": name, "ep": ep, "steps_counted": steps,
            "all_to_all_bytes_total": payload, "formula_bytes_total": formula,
            "all_to_all_bytes_per_rank_step": round(payload / (steps * ep)),
            "formula_bytes_per_rank_step": round(formula / (steps * ep)),
            "ratio": round(payload / formula, 6), "every_step_exact": exact,
            "wire_bytes_per_rank_step": round(wire / (steps * ep)), "wire_fraction": round(wire / payload, 4),
            "uniform_wire_fraction": round((ep - 1) / ep, 4),
            "dropped_total": dropped_total, "assignments_total": assignments,
            "dropped_fraction": round(dropped_total / assignments, 4),
            "tokens_per_step": tokens, "n_layers": cfg.n_layers, "n_experts": cfg.n_experts, "top_k": cfg.top_k,
            "d_model": cfg.d_model}


def run_ep(cfg: Config, ep: int, corpus: ByteCorpus) -> dict[str, Any]:
    """One launch of `ep` thread ranks: emits the rows, bytes, parity and ratio lines; returns a summary."""
    load_start = loadavg()
    t0 = time.perf_counter()
    results = sw.launch(_rank_main, ep, cfg, corpus, timeout=600)
    wall = round(time.perf_counter() - t0, 1)
    names = list(results[0]["times"])
    per_step = {n: max_over_ranks([r["times"][n] for r in results]) for n in names}
    rows = {n: {"name": n, "ep": ep, **step_stats(per_step[n])} for n in names}
    cf = names[1]
    for row in rows.values():
        emit(row)
    lines = {n: _bytes_line(cfg, ep, n, [r["bytes"][n] for r in results]) for n in ("dropless", cf)}
    lines[cf]["capacity_per_expert_and_rank"] = results[0]["capacity"]
    for line in lines.values():
        emit(line)
    # Dropless expert parallel is one process's step on the global batch: the mean of the ranks' losses (each the
    # mean over its equal share, plus the global auxiliary loss) equals the one-process loss, step by step.
    mean_loss = [sum(v) / ep for v in zip(*(r["losses"]["dropless"] for r in results))]
    parity = max(abs(a - b) for a, b in zip(mean_loss, results[0]["losses"]["one_process"]))
    emit({"parity": "dropless loss (mean over ranks) vs one_process, every measured step", "ep": ep,
          "max_abs_diff": parity})

    def ratio(a: str, b: str) -> dict[str, float]:
        paired = per_round_ratios(per_step[a], per_step[b], cfg.steps, cfg.rounds)
        return {"ratio": round(rows[a]["median_ms"] / rows[b]["median_ms"], 3), "paired": round(median(paired), 3)}

    ratios = {f"{cf}/dropless": ratio(cf, "dropless"), "dropless/one_process": ratio("dropless", "one_process"),
              "dropless/no_comm_floor": ratio("dropless", "no_comm_floor")}
    emit({"ratios": ratios, "ep": ep, "loadavg_start": load_start, "loadavg_end": loadavg(), "wall_s": wall})
    return {"rows": rows, "bytes": lines, "ratios": ratios, "parity": parity, "loadavg": loadavg()}


def _summary(cfg: Config, ep: int, out: dict[str, Any]) -> None:
    err = sys.stderr
    print(f"\nep={ep}: {ep} thread ranks x 1 thread, global batch {ep} x {cfg.batch_size} x {cfg.seq_len} tokens, "
          f"{cfg.rounds} rounds x {cfg.steps} steps alternating (load average {out['loadavg']}):", file=err)
    for r in out["rows"].values():
        print(f"  {r['name']:<14} median {r['median_ms']:8.1f} ms  (p10 {r['p10_ms']:.1f}, p90 {r['p90_ms']:.1f}, "
              f"n={r['steps']})", file=err)
    for name, b in out["bytes"].items():
        print(f"  {name:<14} all-to-all {b['all_to_all_bytes_per_rank_step']:,} B/rank/step, formula "
              f"{b['formula_bytes_per_rank_step']:,} (ratio {b['ratio']}), wire fraction {b['wire_fraction']} "
              f"(uniform {b['uniform_wire_fraction']}), dropped {b['dropped_fraction']:.2%}", file=err)
    print("  " + "; ".join(f"{k} {v['ratio']} (paired {v['paired']})" for k, v in out["ratios"].items())
          + f"; parity {out['parity']:.1e}", file=err)


QUICK = dict(d_model=32, n_heads=2, n_layers=1, seq_len=32, batch_size=2, steps=2, rounds=2, warmup=1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    d = Config()
    ap.add_argument("--ep", type=lambda s: comma_list(s, int), default=[2, 4], help="expert-parallel sizes (2,4)")
    ap.add_argument("--d-model", type=int, default=d.d_model)
    ap.add_argument("--n-heads", type=int, default=d.n_heads)
    ap.add_argument("--n-layers", type=int, default=d.n_layers)
    ap.add_argument("--seq-len", type=int, default=d.seq_len)
    ap.add_argument("--n-experts", type=int, default=d.n_experts)
    ap.add_argument("--top-k", type=int, default=d.top_k)
    ap.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per rank (8)")
    ap.add_argument("--capacity-factor", type=float, default=d.capacity_factor, help="the dropping row's (1.25)")
    ap.add_argument("--steps", type=int, default=d.steps, help="measured steps per row per round (5)")
    ap.add_argument("--rounds", type=int, default=d.rounds, help="alternation rounds (5)")
    ap.add_argument("--warmup", type=int, default=d.warmup, help="unmeasured steps of each row first (2)")
    ap.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK} (explicit flags still win)")
    args = ap.parse_args(argv)
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(Config) if hasattr(args, f.name)}
    if args.quick:
        given = {a.lstrip("-").split("=")[0].replace("-", "_") for a in (argv if argv is not None else sys.argv[1:])}
        values.update({k: v for k, v in QUICK.items() if k not in given})
    cfg = Config(**values)
    if min(cfg.steps, cfg.rounds) < 1 or cfg.warmup < 0:
        ap.error("--steps and --rounds must be >= 1, --warmup >= 0")
    bad = [ep for ep in args.ep if ep < 2 or cfg.n_experts % ep]
    if bad:
        ap.error(f"--ep {bad}: each must be >= 2 and divide --n-experts {cfg.n_experts}")
    torch.set_num_threads(1)
    corpus = bench_corpus()
    params = GPT(cfg.model(), seed=0).num_parameters()
    emit({"bench": "experts", "config": dataclasses.asdict(cfg), "params": params, "ep": args.ep,
          "capacity_per_expert_and_rank": math.ceil(cfg.capacity_factor * cfg.batch_size * cfg.seq_len * cfg.top_k
                                                    / cfg.n_experts),
          "torch_threads": torch.get_num_threads(), "loadavg": loadavg()})
    for ep in args.ep:
        _summary(cfg, ep, run_ep(cfg, ep, corpus))
    emit({"loadavg_end": loadavg()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
