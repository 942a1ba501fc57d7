"""`shardwise bench`: shardwise's data-parallel strategies and their peers side by side, one table and three plots.

Mechanism
---------
1. Which rows can run: every row of `peers.ORDER` asked for whose library imports (`peers.missing`); the others
   become table rows that say what is missing and how to install it.
2. The timed run: ONE `shardwise.launch(..., backend="gloo")` of `nproc` processes (one intra-op thread each) builds
   every runnable row on every rank (the same GPT, same seed) and trains them alternating (`timing.alternate`):
   `warmup` steps each, then `rounds` rounds of `steps` steps per row, the order rotating every round, so slow
   phases of a shared machine hit every row alike. Every row sees batch k at its k-th step (same data). Per step
   the slowest rank's time counts; a row's figure is the median (and deciles) over its measured steps. shardwise
   rows count their traffic with `CommStats` (wire bytes of the last step, a steady one: ZeRO-1/2 all-gather the
   updated parameters at the start of the next step); peers cannot be counted from here, so their column shows the
   textbook formula for their strategy (`formulas`), marked as such.
3. The memory runs: rows that share processes share one peak RSS, so each row then runs alone in fresh processes
   for `memory_steps` steps: its peak RSS above the peak before the model was built (the library already
   imported), and its model states per rank (params + grads + optimizer state, `peers.Runner.held_bytes`),
   compared with `sw.estimate_memory` (fp32 AdamW: 16 bytes per parameter for DDP, ZeRO paper section 5).
4. The checks: the no-communication floor must be the fastest row, or the report says why not
   (`report.floor_check`); the load average before and after is printed and recorded, with a warning when it
   exceeds the usable cores (`timing.load_warning`: single figures are then noise, only this run's ratios hold).
5. The run directory (`runs/bench-<YYYYmmdd-HHMMSS>` by default): results.md (the table, the floor check, the
   missing peers with their install line, the machine and configuration), results.jsonl (one JSON line per row,
   after one line for the run), step_time.png, memory.png and bytes.png (matplotlib: `pip install
   'shardwise[bench]'`).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from ..comm.base import Communicator
from ..estimate import estimate_memory
from ..launch import launch
from ..models.gpt import GPT, PRESETS
from ..whole.memory import peak_rss_bytes
from . import formulas
from .peers import ORDER, PEERS, build, missing, prepare
from .report import BenchResult, floor_check, write_report
from .timing import alternate, bench_corpus, gpt_config, load_warning, loadavg, max_over_ranks, step_stats

__all__ = ["BenchConfig", "BenchResult", "run_bench", "default_out"]


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"bench: {name}={value!r} must be an int >= {minimum}")


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """One benchmark run (picklable: gloo ranks receive it).

    impls: the rows, in table order (keys of peers.PEERS). nproc: gloo processes. preset: the GPT preset
    (models.gpt.PRESETS); seq_len overrides its sequence length. batch_size: sequences per rank per step.
    warmup: unmeasured steps per row (>= 1, so the measured steps are steady ones); rounds x steps: measured steps
    per row, alternating. memory_steps: steps of each row's separate memory run (0: no memory runs). lr: AdamW's
    learning rate. seed: model init and data. timeout: seconds a collective may wait.
    `BenchConfig.quick()` is `shardwise bench --quick`: the "small" preset (3.3M parameters), well under 5
    minutes on 2 cores.
    """

    impls: tuple[str, ...] = ORDER
    nproc: int = 2
    preset: str = "bench"
    seq_len: int | None = None
    batch_size: int = 8
    warmup: int = 3
    rounds: int = 5
    steps: int = 4
    memory_steps: int = 3
    lr: float = 1e-3
    seed: int = 0
    timeout: float = 300.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "impls", tuple(self.impls))
        unknown = [name for name in self.impls if name not in PEERS]
        if unknown or not self.impls:
            raise ValueError(f"bench: impls={list(self.impls)!r} must be a non-empty list of {list(PEERS)}")
        if len(set(self.impls)) != len(self.impls):
            raise ValueError(f"bench: impls={list(self.impls)!r} names a row twice")
        if self.preset not in PRESETS:
            raise ValueError(f"bench: preset={self.preset!r} is not one of {sorted(PRESETS)}")
        for name in ("nproc", "batch_size", "warmup", "rounds", "steps"):
            _check_int(name, getattr(self, name), 1)
        _check_int("memory_steps", self.memory_steps, 0)
        if self.seq_len is not None:
            _check_int("seq_len", self.seq_len, 1)
        if not self.lr > 0 or not self.timeout > 0:
            raise ValueError(f"bench: lr={self.lr!r} and timeout={self.timeout!r} must be positive numbers")

    @classmethod
    def quick(cls, **overrides: Any) -> BenchConfig:
        """`--quick`: the small preset, 4 sequences per rank, 2 + 3 x 3 steps per row, 2-step memory runs."""
        settings: dict[str, Any] = dict(preset="small", batch_size=4, warmup=2, rounds=3, steps=3, memory_steps=2)
        return cls(**{**settings, **overrides})


def default_out() -> Path:
    """runs/bench-<YYYYmmdd-HHMMSS>, the default run directory."""
    return Path("runs") / f"bench-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"


# ---- the ranks ------------------------------------------------------------------------------------------------------
def _batches(cfg: BenchConfig) -> tuple[Any, int]:
    """The corpus (read inside each rank, never pickled over) and the sequence length."""
    return bench_corpus(), gpt_config(cfg.preset, cfg.seq_len).seq_len


def timed_rank(comm: Communicator, cfg: BenchConfig, names: list[str]) -> dict[str, Any]:
    """Every row built here, trained alternating (see the module docstring); per row its step times on this rank,
    the loss of its last step, and for shardwise rows the wire bytes and calls of the last step."""
    corpus, seq_len = _batches(cfg)
    for name in names:
        prepare(name)
    config = gpt_config(cfg.preset, cfg.seq_len)
    runners = [build(name, comm, GPT(config, seed=cfg.seed), cfg.lr, cfg.batch_size) for name in names]
    position = dict.fromkeys(names, 0)
    out: dict[str, dict[str, Any]] = {name: {"times": [], "loss": None, "wire_bytes": None, "ops": None}
                                      for name in names}

    def one(runner: Any, measured: bool) -> None:
        row = out[runner.name]
        x, y = corpus.batch(position[runner.name], cfg.batch_size, seq_len, seed=cfg.seed, rank=comm.rank,
                            world_size=comm.size)
        position[runner.name] += 1
        with comm.stats.measure() as counted:
            start = time.perf_counter()
            row["loss"] = runner.step(x, y)
            seconds = time.perf_counter() - start
        if PEERS[runner.name].library == "shardwise" or runner.name == "local":
            row["wire_bytes"] = counted.wire_bytes()
            row["ops"] = {op: c["calls"] for op, c in counted.as_dict().items()}
        if measured:
            row["times"].append(seconds)

    for runner in runners:
        for _ in range(cfg.warmup):
            one(runner, False)
    alternate(runners, cfg.rounds, cfg.steps, lambda runner: one(runner, True), comm.barrier)
    return out


def memory_rank(comm: Communicator, cfg: BenchConfig, name: str) -> dict[str, Any]:
    """One row alone in fresh processes: its peak RSS above the peak before it was built, and its model states."""
    corpus, seq_len = _batches(cfg)
    prepare(name)
    model = GPT(gpt_config(cfg.preset, cfg.seq_len), seed=cfg.seed)
    before = peak_rss_bytes()
    runner = build(name, comm, model, cfg.lr, cfg.batch_size)
    runner.track_memory = True
    for step in range(cfg.memory_steps):
        runner.step(*corpus.batch(step, cfg.batch_size, seq_len, seed=cfg.seed, rank=comm.rank,
                                  world_size=comm.size))
    return {"peak_rss": peak_rss_bytes(), "peak_before": before, "model_states": runner.held_bytes()}


# ---- the parent -----------------------------------------------------------------------------------------------------
def _row(name: str, cfg: BenchConfig, num_params: int, grad_bytes: int) -> dict[str, Any]:
    peer = PEERS[name]
    estimate = estimate_memory(num_params, formulas.estimate_key(peer.strategy),
                               1 if peer.strategy == "none" else cfg.nproc, mixed_precision=False)
    return {"row": name, "label": peer.label, "library": peer.library, "strategy": peer.strategy,
            "peer_of": peer.peer_of, "status": "ok", "reason": None, "install": None,
            "formula": formulas.formula_text(peer.strategy),
            "formula_wire_bytes": formulas.wire_bytes_formula(peer.strategy, grad_bytes, cfg.nproc),
            "estimate_model_states": int(estimate.total)}


def run_bench(cfg: BenchConfig, out: str | os.PathLike[str] | None = None, *, echo: bool = True) -> BenchResult:
    """Run the benchmark (see the module docstring), write the run directory, print the table (echo); return it.

    out: the run directory (created; an existing one must be empty). Raises ValueError for an `out` that is a
    file or a non-empty directory, LaunchError when a rank fails.
    """
    run_dir = Path(out) if out is not None else default_out()
    if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        raise ValueError(f"bench: out={str(run_dir)!r} exists and is not an empty directory; give a new one")
    config = gpt_config(cfg.preset, cfg.seq_len)
    with torch.device("meta"):  # counts parameters without allocating them
        num_params = GPT(config).num_parameters()
    grad_bytes = 4 * num_params  # fp32 gradients
    rows = {name: _row(name, cfg, num_params, grad_bytes) for name in cfg.impls}
    runnable = []
    for name in cfg.impls:
        reason = missing(name)
        if reason is None:
            runnable.append(name)
        else:
            rows[name].update(status="missing", reason=reason, install=PEERS[name].install)
    say = print if echo else (lambda *a, **k: None)
    tokens = cfg.batch_size * config.seq_len * cfg.nproc
    say(f"shardwise bench: GPT {cfg.preset!r} ({num_params / 1e6:.2f}M params), {cfg.nproc} gloo ranks, "
        f"{tokens:,} tokens/step; rows {', '.join(runnable)}"
        + "".join(f"\n  {name}: not run ({rows[name]['reason']}; install: {rows[name]['install']})"
                  for name in cfg.impls if name not in runnable), flush=True)
    started = time.perf_counter()
    load_before = loadavg()
    say(f"  load average before: {', '.join(map(str, load_before))} (1, 5, 15 min) on {os.cpu_count()} CPUs",
        flush=True)
    if load_warning(load_before):
        say(f"  {load_warning(load_before)}", flush=True)
    if runnable:
        say(f"  timed run: {len(runnable)} rows alternating, {cfg.warmup} + {cfg.rounds} x {cfg.steps} steps each",
            flush=True)
        timed = launch(timed_rank, cfg.nproc, cfg, runnable, backend="gloo", threads_per_rank=1,
                       timeout=cfg.timeout)
        for name in runnable:
            per_step = max_over_ranks([rank[name]["times"] for rank in timed])
            stats = step_stats(per_step)
            lead = timed[0][name]
            rows[name].update(stats, tokens_per_s=round(tokens / (stats["median_ms"] / 1e3)), loss=lead["loss"],
                              wire_bytes=lead["wire_bytes"], ops=lead["ops"],
                              wire_bytes_source="formula" if lead["wire_bytes"] is None else "measured")
        floor = rows["local"]["median_ms"] if "local" in runnable else None
        for name in runnable:
            rows[name]["vs_floor"] = round(rows[name]["median_ms"] / floor, 3) if floor else None
        if cfg.memory_steps:
            for name in runnable:
                say(f"  memory run: {name} ({time.perf_counter() - started:.0f} s so far)", flush=True)
                ranks = launch(memory_rank, cfg.nproc, cfg, name, backend="gloo", threads_per_rank=1,
                               timeout=cfg.timeout)
                states = [r["model_states"] for r in ranks]
                rows[name].update(peak_rss_delta=max(r["peak_rss"] - r["peak_before"] for r in ranks),
                                  peak_rss=max(r["peak_rss"] for r in ranks),
                                  model_states=None if None in states else max(states))
    load_after = loadavg()
    header = {"config": dataclasses.asdict(cfg), "num_params": num_params, "grad_bytes": grad_bytes,
              "tokens_per_step": tokens, "seq_len": config.seq_len, "torch": torch.__version__,
              "python": platform.python_version(), "cpus": os.cpu_count(), "loadavg_before": load_before,
              "loadavg_after": load_after, "wall_s": round(time.perf_counter() - started, 1),
              "started": datetime.datetime.now().isoformat(timespec="seconds"),
              "floor_check": floor_check(list(rows.values())) if runnable else None,
              "load_warning": load_warning(load_before) or load_warning(load_after)}
    result = BenchResult(run_dir, [rows[name] for name in cfg.impls], header)
    table = write_report(result)
    say(table)
    if header["floor_check"]:
        say(header["floor_check"])
    if header["load_warning"]:
        say(header["load_warning"])
    say(f"run directory: {run_dir}")
    return result
