"""Benchmark: grouping many tiny layers into few sharding units (wrap="auto") against one unit per layer, ZeRO-3.

The model is `--layers` (default 1,000) tiny `nn.Linear(--width, --width)` in one nn.Sequential, then an MSE loss.
shardwise ZeRO-3 wraps it twice in the SAME gloo processes (`shardwise.launch(..., backend="gloo",
threads_per_rank=1)`): with `wrap="auto"` (consecutive small layers merged into units of about `group_mb`; one row per
--group-mb value) and with `wrap=nn.Linear` (one unit per layer, i.e. one all-gather in forward, one in backward and
one reduce-scatter per layer). The rows ALTERNATE (`--rounds` rounds of `--steps` steps each, order rotating) after
`--warmup` steps; a step is forward + backward + AdamW step + zero_grad, its time the max over ranks, the figure the
median over measured steps. Collectives per step are counted with `comm.stats.measure()` around one step
(all_gather and reduce_scatter calls). The issue's target: >= 20x fewer collectives per step grouped than per-layer.
A `local` row (the plain model, no hooks, no communication; --no-local drops it) gives the floor.
Parity: every row trains the same init on the same data, so the final parameters must agree across rows.

stdout carries JSON lines only (one per row, a parity line, optionally a profile line, then the ratio line); the
human-readable summary goes to stderr.

    .venv/bin/python bench/grouping.py                         # 1,000 layers of 16x16: the default, then a sweep
    .venv/bin/python bench/grouping.py --group-mb 25 --profile  # + cProfile of one step of each row
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import pstats
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import shardwise

from shardwise.benchmarks.timing import alternate, comma_list, emit, loadavg, max_over_ranks, step_stats

GOAL = 20.0  # the target: per-layer collectives / grouped collectives >= 20
GOAL_VS_BEST = 1.1  # the default's step time within 1.1x of the best group size of the sweep


@dataclasses.dataclass(frozen=True)
class Config:
    layers: int
    width: int
    batch_size: int
    steps: int
    rounds: int
    warmup: int
    nproc: int
    group_mbs: tuple[float | None, ...]  # None: wrap="auto" picks the size from the model (the default)
    profile: bool
    local: bool = True
    lr: float = 1e-3
    seed: int = 0


class TinyLayers(nn.Module):
    """`layers` Linear(width, width) in one nn.Sequential; forward(x, y) returns the MSE loss."""

    def __init__(self, layers: int, width: int, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        with torch.no_grad():  # identity-ish layers keep the signal (and gradients) alive through 1,000 of them
            for layer in self.layers:
                layer.weight.copy_(torch.eye(width) + 0.02 * torch.randn(width, width, generator=gen))
                layer.bias.copy_(0.01 * torch.randn(width, generator=gen))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.layers(x), y)


class _Impl:
    def __init__(self, name: str, model: nn.Module, lr: float, **info: Any) -> None:
        self.name = name
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr)
        self.step_no = 0
        self.info = info
        self.times: list[float] = []
        self.collectives: dict[str, Any] = {}


def _batch(cfg: Config, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 101 + rank)
    x = torch.randn(cfg.batch_size, cfg.width, generator=gen)
    return x, x.flip(-1) + 0.1 * torch.randn(cfg.batch_size, cfg.width, generator=gen)


def _step(impl: _Impl, cfg: Config, rank: int) -> float:
    x, y = _batch(cfg, impl.step_no, rank)
    impl.step_no += 1
    t0 = time.perf_counter()
    loss = impl.model(x, y)
    loss.backward()
    impl.opt.step()
    impl.opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def _row_name(mb: float | None) -> str:
    return "default[auto]" if mb is None else f"grouped[{mb:g}MB]"


def _build(comm: shardwise.Communicator, cfg: Config) -> list[_Impl]:
    impls = []
    for mb in cfg.group_mbs:
        model = shardwise.ZeRO(TinyLayers(cfg.layers, cfg.width, cfg.seed), comm, stage=3, wrap="auto", group_mb=mb)
        impls.append(_Impl(_row_name(mb), model, cfg.lr, wrap="auto", group_mb=mb,
                           units=len(model.sharding_units())))
    model = shardwise.ZeRO(TinyLayers(cfg.layers, cfg.width, cfg.seed), comm, stage=3, wrap=nn.Linear)
    impls.append(_Impl("per_layer", model, cfg.lr, wrap="nn.Linear", units=len(model.sharding_units())))
    if cfg.local:  # the floor: the plain model, no hooks, no communication (each rank trains its own replica)
        impls.append(_Impl("local", TinyLayers(cfg.layers, cfg.width, cfg.seed), cfg.lr, wrap="none", units=0))
    return impls


def _count(impl: _Impl, comm: shardwise.Communicator, cfg: Config) -> None:
    if impl.name == "local":
        impl.collectives = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0, "wire_bytes": 0, "collectives": 0}
        return
    with comm.stats.measure() as counted:
        t = _step(impl, cfg, comm.rank)
    impl.collectives = {"all_gather": counted.calls("all_gather"), "reduce_scatter": counted.calls("reduce_scatter"),
                        "all_reduce": counted.calls("all_reduce"), "wire_bytes": counted.wire_bytes(),
                        "step_ms_while_counting": round(t * 1e3, 1)}
    impl.collectives["collectives"] = sum(impl.collectives[k] for k in ("all_gather", "reduce_scatter", "all_reduce"))
    # Model states per rank against the ZeRO-3 formula 16 psi / N (fp32 Adam): measured after backward and the
    # optimizer step, before zero_grad, so parameters, gradients and AdamW's state are all held.
    x, y = _batch(cfg, impl.step_no, comm.rank)
    impl.step_no += 1
    impl.model(x, y).backward()
    impl.opt.step()
    stats = shardwise.memory_stats(impl.model, impl.opt)
    impl.opt.zero_grad(set_to_none=True)
    psi = sum(u["params"] for u in impl.model.sharding_units())
    impl.info["model_state_bytes"] = stats.model_states
    impl.info["model_state_over_16psi_n"] = round(stats.model_states / (16 * psi / comm.size), 4)


def _cprofile(impl: _Impl, comm: shardwise.Communicator, cfg: Config, n: int = 3) -> list[dict[str, Any]]:
    """cProfile of n steps: the functions with the most own time (ms per step)."""
    comm.barrier()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        _step(impl, cfg, comm.rank)
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (file, line, func), (cc, nc, tt, ct, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{file.split('/')[-1]}:{line}({func})", "own_ms": round(tt * 1e3 / n, 2),
                     "cum_ms": round(ct * 1e3 / n, 2), "calls": nc // n})
    rows.sort(key=lambda r: -r["own_ms"])
    return rows[:15]


def _rank_main(comm: shardwise.Communicator, cfg: Config) -> dict[str, Any]:
    impls = _build(comm, cfg)
    for impl in impls:
        for _ in range(cfg.warmup):
            _step(impl, cfg, comm.rank)
        _count(impl, comm, cfg)  # counted after warm-up: the forward order is recorded and prefetch is on
    alternate(impls, cfg.rounds, cfg.steps, lambda impl: impl.times.append(_step(impl, cfg, comm.rank)), comm.barrier)
    full = {i.name: shardwise.full_state_dict(i.model) for i in impls if i.name != "local"}
    ref = full["per_layer"]
    parity = {name: max((sd[k] - ref[k]).abs().max().item() for k in ref) for name, sd in full.items()
              if name != "per_layer"}
    result = {"times": {i.name: i.times for i in impls}, "info": {i.name: i.info for i in impls},
              "collectives": {i.name: i.collectives for i in impls}, "parity": parity,
              "trained_steps": impls[0].step_no}
    if cfg.profile:
        result["profile"] = {i.name: _cprofile(i, comm, cfg) for i in impls if i.name != "local"}
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=1000, help="number of Linear layers (default 1000)")
    ap.add_argument("--width", type=int, default=16, help="Linear(width, width) (default 16)")
    ap.add_argument("--batch-size", type=int, default=32, help="rows per rank per step (default 32)")
    ap.add_argument("--group-mb", default="auto,25,2,0.5,0.1",
                    help="group_mb of wrap='auto' ('auto': chosen from the model, the default); a comma list adds "
                         "rows: the sweep the default is judged against (default auto,25,2,0.5,0.1)")
    ap.add_argument("--steps", type=int, default=4, help="measured steps per row per round (default 4)")
    ap.add_argument("--rounds", type=int, default=5, help="alternation rounds (default 5)")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps of each row first (default 2)")
    ap.add_argument("--nproc", type=int, default=2, help="gloo processes, 1 thread each (default 2)")
    ap.add_argument("--profile", action="store_true", help="also cProfile 3 steps of each row (own time per function)")
    ap.add_argument("--no-local", action="store_true", help="skip the 'local' row (plain model, no communication)")
    args = ap.parse_args(argv)
    if args.nproc < 2 or min(args.layers, args.width, args.steps, args.rounds, args.warmup) < 1:
        ap.error("--nproc must be >= 2; --layers, --width, --steps, --rounds, --warmup >= 1")
    group_mbs = tuple(None if v == "auto" else float(v) for v in comma_list(args.group_mb))
    cfg = Config(args.layers, args.width, args.batch_size, args.steps, args.rounds, args.warmup, args.nproc,
                 group_mbs, args.profile, not args.no_local)
    nparams = sum(p.numel() for p in TinyLayers(cfg.layers, cfg.width, 0).parameters())

    t0 = time.time()
    results = shardwise.launch(_rank_main, cfg.nproc, cfg, backend="gloo", threads_per_rank=1, timeout=900)
    rows = []
    for name in results[0]["times"]:
        row = {"name": name, **step_stats(max_over_ranks([r["times"][name] for r in results])),
               **results[0]["info"][name], "collectives_per_step": results[0]["collectives"][name],
               "layers": cfg.layers, "width": cfg.width, "params": nparams, "nproc": cfg.nproc}
        rows.append(row)
        emit(row)
    parity = {name: max(r["parity"][name] for r in results) for name in results[0]["parity"]}
    emit({"parity_max_abs_diff_vs_per_layer": parity, "trained_steps": results[0]["trained_steps"]})
    if cfg.profile:
        emit({"profile_rank0": results[0]["profile"]})

    by_name = {r["name"]: r for r in rows}
    per_layer = by_name["per_layer"]
    n_per_layer = per_layer["collectives_per_step"]["collectives"]
    summary = {}
    for r in rows:
        if r["name"] in ("per_layer", "local"):
            continue
        n = r["collectives_per_step"]["collectives"]
        fewer = n_per_layer / n
        summary[r["name"]] = {"collectives_per_step": n, "per_layer_collectives_per_step": n_per_layer,
                              "fewer_x": round(fewer, 1), "goal_x": GOAL, "meets_goal": fewer >= GOAL,
                              "step_time_ratio_grouped_over_per_layer": round(r["median_ms"] / per_layer["median_ms"],
                                                                              3)}
        if "local" in by_name:
            summary[r["name"]]["step_time_over_local"] = round(r["median_ms"] / by_name["local"]["median_ms"], 3)
    default = by_name.get(_row_name(None))
    swept = [r for r in rows if r["name"].startswith("grouped[")]
    if default is not None and swept:
        best = min(swept + [default], key=lambda r: r["median_ms"])
        summary["default_vs_best"] = {
            "best": best["name"], "best_median_ms": best["median_ms"],
            "default_over_best": round(default["median_ms"] / best["median_ms"], 3), "goal": GOAL_VS_BEST,
            "meets_goal": default["median_ms"] <= GOAL_VS_BEST * best["median_ms"],
            "default_model_state_over_16psi_n": default["model_state_over_16psi_n"]}
    emit({"ratios": summary, "wall_s": round(time.time() - t0, 1), "loadavg": loadavg()})

    err = sys.stderr
    print(f"\nZeRO-3 grouping, {cfg.layers} x Linear({cfg.width}, {cfg.width}) ({nparams / 1e3:.0f} k params), "
          f"{cfg.nproc} gloo ranks x 1 thread, batch {cfg.batch_size}/rank, {cfg.rounds} rounds x {cfg.steps} steps "
          f"alternating (max over ranks):", file=err)
    for r in rows:
        c = r["collectives_per_step"]
        print(f"  {r['name']:<16} units {r['units']:5d}  collectives/step {c['collectives']:5d} "
              f"(all_gather {c['all_gather']}, reduce_scatter {c['reduce_scatter']})  median {r['median_ms']:8.1f} ms "
              f"(p10 {r['p10_ms']:.1f}, p90 {r['p90_ms']:.1f})", file=err)
    for name, s in summary.items():
        if name == "default_vs_best":
            print(f"  default (group_mb chosen from the model) / best of the sweep ({s['best']}) step time "
                  f"{s['default_over_best']:.3f} (goal <= {GOAL_VS_BEST}: {'met' if s['meets_goal'] else 'NOT met'});"
                  f" model states / (16 psi/N) = {s['default_model_state_over_16psi_n']:.4f}", file=err)
            continue
        print(f"  {name}: {s['fewer_x']:.1f}x fewer collectives than per_layer (goal >= {GOAL:g}x: "
              f"{'met' if s['meets_goal'] else 'NOT met'}); step time / per_layer's "
              f"{s['step_time_ratio_grouped_over_per_layer']:.3f}", file=err)
    if "local" in by_name:
        print(f"  per_layer / local (no communication) step time = "
              f"{per_layer['median_ms'] / by_name['local']['median_ms']:.2f}x", file=err)
    print(f"  parity max|diff| vs per_layer: {max(parity.values()):.2e}", file=err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
