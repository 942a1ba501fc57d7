"""Benchmark: what asynchrony buys with one slow rank. Synchronous DDP against the parameter server (s = 0, 2, 8,
inf), local SGD (H = 8, 32), DiLoCo (H = 32) and Streaming DiLoCo (`streaming:H:F[:tau]`: F fragments, overlap tau),
on gloo processes, one of the workers slowed `--factor` x (`--straggler rotating`: each worker in turn).

Every mode trains the same GPT (same seed, AdamW for DDP / local SGD / the servers, AdamW inner for DiLoCo) on
`--workers` workers for `--seconds` of wall time; worker `--workers - 1` is a straggler (`sw.async_sgd.Straggler`:
it sleeps (factor - 1) x its compute time, a slower machine that takes no CPU from the others). The parameter
server adds one server rank. Collective modes decide together when to stop (`sw.agree` at each synchronisation), the
parameter server's workers each on their own clock.

Per mode: samples per second (all workers' samples / wall time), bytes per sample (every rank's wire bytes after
wrapping: ring all-reduce cost, point-to-point payloads), and the training loss at equal samples seen: every
worker's (time, loss) events are merged in time order, samples accumulate, and the loss is the mean over the last
20% of the first S samples, S the smallest total any mode reached. `--rounds` rounds run the modes in rotating
order; the figures are medians over rounds. stdout carries JSON lines only (one per mode per round, then a summary
line per mode); `--plot` writes loss against time (and samples) for the last round.

`--pretrain-steps P`: every mode starts from the same model, trained once for P synchronous steps on the global
batch (one process on workers x batch rows: DDP's update, by the parity contract), as the DiLoCo paper starts DiLoCo
from a synchronously pretrained model; each mode then trains on the batches after those P (fresh optimizers). The P
steps' samples are the same for every mode and are not in the per-mode figures. Per mode also: the peak wire bytes
of one step on one rank (DiLoCo's whole-model synchronisation, Streaming DiLoCo's ~1/F).

    .venv/bin/python bench/async_sgd.py --steps 300 --rounds 3 --plot docs/async_sgd.png   # docs/async.md's figures
    .venv/bin/python bench/async_sgd.py --seconds 60 --rounds 3 --preset small            # for a wall time instead
    .venv/bin/python bench/async_sgd.py --steps 300 --rounds 2 --modes ddp,ps:8 --straggler rotating   # transient
    .venv/bin/python bench/async_sgd.py --seconds 4 --rounds 1 --modes ddp,ps:8,diloco:32          # a smoke run
    .venv/bin/python bench/async_sgd.py --steps 1200 --pretrain-steps 300 --rounds 2 --factor 1 \
        --modes ddp,diloco:32,local:32,streaming:32:4,streaming:32:4:4                          # DiLoCo's loss
On a 2-core host 4-5 processes are oversubscribed: absolute speeds are low and noisy, the ratios are what counts.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from typing import Any

import torch

import shardwise as sw
from shardwise.async_sgd import AsyncSGD, DiLoCo, LocalSGD, RotatingStraggler, Straggler, StreamingDiLoCo
from shardwise.models.gpt import GPT

from shardwise.benchmarks.timing import bench_corpus, comma_list, emit, gpt_config, loadavg, median, rotations

DEFAULT_MODES = "ddp,ps:0,ps:2,ps:8,ps:inf,local:8,local:32,diloco:32"


def parse_mode(mode: str) -> tuple[str, float, dict[str, int]]:
    """(kind, value, options): value is s for ps, H for local / diloco / streaming; streaming's F and tau in
    options."""
    kind, _, value = mode.partition(":")
    try:
        if kind == "ddp" and not value:
            return kind, 0, {}
        if kind in ("ps", "local", "diloco") and value:
            return kind, math.inf if value == "inf" else int(value), {}
        if kind == "streaming":
            parts = [int(v) for v in value.split(":")]
            if len(parts) in (2, 3):
                return kind, parts[0], {"fragments": parts[1], "overlap_steps": parts[2] if len(parts) == 3 else 0}
    except ValueError:
        pass
    raise ValueError(f"--modes: {mode!r} is not one of ddp, ps:<s|inf>, local:<H>, diloco:<H>, "
                     f"streaming:<H>:<F>[:<tau>]")


HELD_OUT_SEED = 1  # the held-out batches' data seed: --seed may not take it


def held_out_loss(model, config, args: argparse.Namespace) -> float:
    """The loss of `model` (the global parameters at the end) on fixed batches no mode trains on (HELD_OUT_SEED): the
    same quantity for every mode, free of the training loss's noise and of whose local copy produced it."""
    corpus = bench_corpus()
    with torch.no_grad():
        batches = (corpus.batch(i, args.batch_size * args.workers, config.seq_len, seed=HELD_OUT_SEED)
                   for i in range(args.eval_batches))
        losses = [float(model(x, y)) for x, y in batches]
    return sum(losses) / len(losses)


def run_mode(comm, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One rank of one mode: train until the time is up (--seconds) or until the samples of --steps synchronous
    global steps are seen (--steps); return this rank's events, wire bytes and (one rank) the held-out loss."""
    kind, value, options = parse_mode(mode)
    torch.manual_seed(args.seed)
    config = gpt_config(args.preset, args.seq_len)
    corpus = bench_corpus()
    model = GPT(config, seed=args.seed)
    if args.pretrained:
        model.load_state_dict(torch.load(args.pretrained, weights_only=True))
    lr = args.lr
    if kind == "ddp":
        model = sw.DDP(model, comm)
    elif kind == "local":
        model = LocalSGD(model, comm, sync_every=int(value))
    elif kind == "diloco":
        model = DiLoCo(model, comm, sync_every=int(value), outer_lr=args.outer_lr, outer_momentum=args.outer_momentum)
    elif kind == "streaming":
        model = StreamingDiLoCo(model, comm, sync_every=int(value), outer_lr=args.outer_lr,
                                outer_momentum=args.outer_momentum, alpha=args.alpha or 0.0, **options)
    else:
        model = AsyncSGD(model, comm, optimizer=lambda ps: torch.optim.AdamW(ps, lr=args.ps_lr or lr), n_servers=1,
                         staleness=value, lr_scaling=None if args.ps_lr_scaling == "none" else args.ps_lr_scaling)
    local = kind in ("local", "diloco", "streaming")
    inner_lr = (args.inner_lr or lr) if local else lr
    opt = None if kind == "ps" else torch.optim.AdamW(model.parameters(), lr=inner_lr)
    # Linear warm-up of the (inner) lr over the first --warmup steps; the servers' optimizer has no schedule.
    sched = None if opt is None or not args.warmup else torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: min(1.0, (k + 1) / args.warmup))
    before = comm.stats.snapshot()
    if kind == "ps" and model.is_server:
        report = model.serve()
        return {"events": [], "wire_bytes": comm.stats.since(before).wire_bytes(),
                "staleness_max": max(report.staleness, default=0),
                "staleness_mean": sum(report.staleness) / max(1, len(report.staleness)),
                "held_out_loss": held_out_loss(model, config, args)}  # n_servers=1: the server holds every tensor
    worker = model.worker_rank if kind == "ps" else comm.rank
    n_workers = model.n_workers if kind == "ps" else comm.size
    target = args.steps * n_workers  # step mode: pushes (worker batches) of all workers together
    slow = Straggler(args.factor if worker == n_workers - 1 else 1.0)  # --straggler fixed: the last worker
    rotating = RotatingStraggler(args.factor, worker, n_workers, args.rotate_every)
    events = []
    peak = 0  # the most wire bytes one step sent from this rank
    start = time.perf_counter()
    step = 0
    while True:
        at = comm.stats.snapshot()
        # After --pretrain-steps P the modes train on the batches after the pretraining's.
        x, y = corpus.batch(args.pretrain_steps + step, args.batch_size, config.seq_len, seed=args.seed,
                            rank=worker, world_size=n_workers)
        with slow if args.straggler == "fixed" else rotating.step(step):
            loss = model(x, y)
            loss.backward()
        if kind == "ps":
            model.step()
            model.zero_grad()
        else:
            opt.step()
            opt.zero_grad()
            if sched is not None:
                sched.step()
            synced = model.step() if local else True
        peak = max(peak, comm.stats.since(at).wire_bytes())
        step += 1
        events.append((time.perf_counter() - start, float(loss.detach())))
        if args.steps:
            # Collective modes step together: every worker stops at --steps. A parameter-server worker stops when
            # the server has taken the samples of --steps synchronous steps from all workers together.
            done = model.pushes_applied >= target if kind == "ps" else step >= args.steps
        else:
            done = time.perf_counter() - start > args.seconds
        if kind == "ps":
            if done:
                model.finish()
                break
        elif args.steps and done:
            break
        elif not args.steps and synced and sw.agree(done, comm, how="any"):
            break
    if kind == "streaming" or (local and not synced):
        # The last steps since a synchronisation join the global model, as a user ends training (Streaming
        # DiLoCo's fragments are never all in step, and mixing keeps the replicas apart: it always ends so).
        model.sync()
    row = {"events": events, "wire_bytes": comm.stats.since(before).wire_bytes(),
           "seconds": time.perf_counter() - start, "peak_step_bytes": peak}
    if kind != "ps" and comm.rank == 0:
        row["held_out_loss"] = held_out_loss(model, config, args)
    return row


def summarise(mode: str, ranks: list[dict[str, Any]], batch: int) -> dict[str, Any]:
    events = sorted(e for r in ranks for e in r["events"])
    samples = len(events) * batch
    seconds = max(r.get("seconds", 0.0) for r in ranks)
    row = {"mode": mode, "samples": samples, "seconds": round(seconds, 2),
           "samples_per_s": round(samples / seconds, 2) if seconds else None,
           "bytes_per_sample": round(sum(r["wire_bytes"] for r in ranks) / max(1, samples)),
           "peak_step_bytes": max(r.get("peak_step_bytes", 0) for r in ranks),
           "curve": [(round(t, 3), loss) for t, loss in events]}
    row["held_out_loss"] = next(r["held_out_loss"] for r in ranks if "held_out_loss" in r)
    server = [r for r in ranks if "staleness_max" in r]
    if server:
        row["staleness_max"] = server[0]["staleness_max"]
        row["staleness_mean"] = round(server[0]["staleness_mean"], 2)
    return row


def loss_at(curve: list[tuple[float, float]], n_events: int) -> float:
    """Mean loss over the last 20% of the first `n_events` events (in time order)."""
    window = curve[:n_events][-max(1, n_events // 5):]
    return sum(loss for _, loss in window) / len(window)


def goals(summaries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's acceptance: PS s = 8 >= 1.8x DDP's samples/s and within 5% of its loss at equal samples (after
    300 steps); DiLoCo H = 32 within 5% of DDP's loss with >= 25x fewer bytes. Loss = both the training loss at
    equal samples and the held-out loss of the final model; a goal is met when both are."""
    out: dict[str, Any] = {}
    ps = summaries.get("ps:8")
    if ps and "speed_vs_ddp" in ps:
        out["ps:8 speed >= 1.8"] = ps["speed_vs_ddp"] >= 1.8
        out["ps:8 loss within 5%"] = max(ps["loss_vs_ddp"], ps["held_out_vs_ddp"]) <= 1.05
    # DiLoCo H = 32's goal, and the same bar for every other DiLoCo / Streaming DiLoCo mode run (informational)
    for m, di in summaries.items():
        if m.startswith(("diloco:", "streaming:")) and di.get("loss_vs_ddp") is not None:
            out[f"{m} bytes >= 25x fewer"] = di["bytes_fewer_than_ddp"] >= 25
            out[f"{m} loss within 5%"] = max(di["loss_vs_ddp"], di["held_out_vs_ddp"]) <= 1.05
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default=DEFAULT_MODES)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--factor", type=float, default=3.0, help="slowdown of the straggler")
    parser.add_argument("--straggler", choices=("fixed", "rotating"), default="fixed",
                        help="fixed: the last worker is the straggler throughout; rotating: each worker in turn for "
                        "--rotate-every of its steps (default: %(default)s)")
    parser.add_argument("--rotate-every", type=int, default=1,
                        help="steps each worker stays the straggler with --straggler rotating (default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=30.0, help="wall time of each mode (without --steps)")
    parser.add_argument("--steps", type=int, default=0,
                        help="train each mode for the samples of this many synchronous global steps (steps x workers "
                             "x batch) instead of --seconds")
    parser.add_argument("--pretrain-steps", type=int, default=0,
                        help="start every mode from the model trained this many synchronous global steps (once)")
    parser.add_argument("--eval-batches", type=int, default=8, help="held-out batches (of workers x batch) "
                        "evaluated on each mode's final global model")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help=f"model initialisation and training data order; not "
                        f"{HELD_OUT_SEED}, the held-out batches' seed (default: %(default)s)")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=4, help="per worker")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW lr of DDP (and default of the others)")
    parser.add_argument("--inner-lr", type=float, default=None, help="inner AdamW lr of local SGD / DiLoCo")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer SGD lr (the paper's 0.7)")
    parser.add_argument("--outer-momentum", type=float, default=0.9, help="DiLoCo's outer Nesterov momentum")
    parser.add_argument("--alpha", type=float, default=None, help="Streaming DiLoCo's mixing weight of the local "
                        "values after an overlapped synchronisation (default 0: replaced by the global values)")
    parser.add_argument("--warmup", type=int, default=0, help="linear lr warm-up steps (DDP, local SGD inner)")
    parser.add_argument("--ps-lr", type=float, default=None, help="the parameter server's AdamW lr")
    parser.add_argument("--ps-lr-scaling", default="workers", choices=["workers", "staleness", "none"],
                        help="AsyncSGD lr_scaling: lr / n_workers per push (the default), lr / (1 + staleness), or "
                             "none (the full lr per push)")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--plot", default=None, help="write loss against time and samples (PNG) here")
    args = parser.parse_args()
    if args.seed == HELD_OUT_SEED:
        parser.error(f"--seed {HELD_OUT_SEED} is the held-out batches' seed: choose another")
    if args.rotate_every < 1:
        parser.error(f"--rotate-every={args.rotate_every} must be >= 1")
    modes = comma_list(args.modes)
    for m in modes:
        parse_mode(m)
    args.pretrained = None
    if args.pretrain_steps:
        args.pretrained = pretrain(args)
    rows: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for order in rotations(modes, args.rounds):
        for mode in order:
            world = args.workers + (1 if mode.startswith("ps:") else 0)
            ranks = sw.launch(run_mode, world, mode, args, backend="gloo", timeout=args.timeout, threads_per_rank=1)
            row = summarise(mode, ranks, args.batch_size)
            rows[mode].append(row)
            emit({k: v for k, v in row.items() if k != "curve"} | {"loadavg": loadavg()})
            print(f"{mode:>10}: {row['samples_per_s']} samples/s, {row['bytes_per_sample']} B/sample", file=sys.stderr)
    # Loss at equal samples seen: the samples of --steps synchronous steps, or (time mode) the smallest number of
    # events any run of the round reached.
    for r in range(args.rounds):
        n = args.steps * args.workers if args.steps else min(len(rows[m][r]["curve"]) for m in modes)
        for m in modes:
            rows[m][r]["loss_at_equal_samples"] = loss_at(rows[m][r]["curve"], n)
    ddp = rows.get("ddp")
    summaries = {}
    for m in modes:
        summary = {"summary": m, "rounds": args.rounds, "steps": args.steps or None,
                   "pretrain_steps": args.pretrain_steps, "peak_step_bytes": max(x["peak_step_bytes"] for x in rows[m]),
                   "samples_per_s": median([x["samples_per_s"] for x in rows[m]]),
                   "bytes_per_sample": median([x["bytes_per_sample"] for x in rows[m]]),
                   "loss_at_equal_samples": round(median([x["loss_at_equal_samples"] for x in rows[m]]), 4),
                   "held_out_loss": round(median([x["held_out_loss"] for x in rows[m]]), 4)}
        if ddp:
            # Ratios per round (the modes of one round ran back to back under the same load), then the median.
            def ratio(key: str, invert: bool = False) -> float | None:
                per = [(d[key] / x[key] if invert else x[key] / d[key]) for x, d in zip(rows[m], ddp) if x[key]]
                return round(median(per), 3) if per else None

            summary["speed_vs_ddp"] = ratio("samples_per_s")
            summary["bytes_fewer_than_ddp"] = ratio("bytes_per_sample", invert=True)
            summary["loss_vs_ddp"] = ratio("loss_at_equal_samples")
            summary["held_out_vs_ddp"] = ratio("held_out_loss")
        summaries[m] = summary
        emit(summary)
    emit({"goals": goals(summaries), "loadavg": loadavg()})
    if args.plot:
        plot(rows, modes, args)
    if args.pretrained:
        os.unlink(args.pretrained)


def pretrain(args: argparse.Namespace) -> str:
    """Train the GPT `--pretrain-steps` synchronous steps on the global batch (workers x batch rows, AdamW at --lr,
    the --warmup schedule) in this process; save its weights to a temporary file and return its path."""
    torch.manual_seed(args.seed)
    config = gpt_config(args.preset, args.seq_len)
    corpus = bench_corpus()
    model = GPT(config, seed=args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sched = None if not args.warmup else torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: min(1.0, (k + 1) / args.warmup))
    start = time.perf_counter()
    for step in range(args.pretrain_steps):
        x, y = corpus.batch(step, args.batch_size * args.workers, config.seq_len, seed=args.seed)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    fd, path = tempfile.mkstemp(suffix=".pt", prefix="async_sgd_pretrained_")
    os.close(fd)
    torch.save(model.state_dict(), path)
    emit({"pretrained": args.pretrain_steps, "samples": args.pretrain_steps * args.workers * args.batch_size,
          "final_loss": round(float(loss.detach()), 4), "held_out_loss": round(held_out_loss(model, config, args), 4),
          "seconds": round(time.perf_counter() - start, 1), "loadavg": loadavg()})
    return path


def plot(rows: dict[str, list[dict[str, Any]]], modes: list[str], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_samples) = plt.subplots(1, 2, figsize=(10, 4))
    for m in modes:
        curve = rows[m][-1]["curve"]
        k = max(1, len(curve) // 50)  # smooth: mean of k consecutive events
        pts = [(curve[i + k - 1][0], sum(l for _, l in curve[i:i + k]) / k, (i + k) * args.batch_size)
               for i in range(0, len(curve) - k + 1, k)]
        by_time.plot([p[0] for p in pts], [p[1] for p in pts], label=m)
        by_samples.plot([p[2] for p in pts], [p[1] for p in pts], label=m)
    by_time.set_xlabel("seconds")
    by_samples.set_xlabel("samples seen (all workers)")
    for ax in (by_time, by_samples):
        ax.set_ylabel("training loss")
        ax.legend(fontsize=8)
    straggler = (("one" if args.straggler == "fixed" else f"each in turn ({args.rotate_every} steps)") +
                 f" {args.factor:g}x slower" if args.factor != 1 else "no straggler")
    start = f", from {args.pretrain_steps} synchronous steps" if args.pretrain_steps else ""
    fig.suptitle(f"{args.workers} workers, {straggler} ({args.preset} GPT, gloo{start})")
    fig.tight_layout()
    fig.savefig(args.plot, dpi=80)
    print(f"plot written to {args.plot}", file=sys.stderr)


if __name__ == "__main__":
    main()
