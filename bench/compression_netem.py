"""Benchmark: gradient compression over a REAL slow link: two network namespaces joined by a veth pair shaped to
100 Mbit/s, one gloo rank in each, the demo GPT trained with uncompressed DDP, our PowerSGD and torch's
`powerSGD_hook` on DistributedDataParallel, alternating in the same processes (issue 15's acceptance).

The link. Two namespaces ("hosts") each hold one end of a veth pair, 198.18.0.1/24 and 198.18.0.2/24 (RFC 2544's
benchmarking range, 198.18.0.0/15, routed nowhere); each end's egress is shaped by `tc qdisc ... root netem rate
<rate> [delay <ms>]`. Where the kernel has no netem (sch_netem not built, as in some VMs), a token-bucket filter
shapes the same rate (`tbf rate <rate> burst 256kb latency 100ms`; no added delay): the JSON header says which
qdisc ran. Before training, one TCP transfer measures the shaped link's throughput, so the figures below rest on a
checked rate. Names carry this process's pid and a random suffix; the namespaces (and with them the veth pair) and
every process started in them are removed at the end, whatever happens.

The training. Rank r runs in namespace r with RANK / WORLD_SIZE / MASTER_ADDR=198.18.0.1 and GLOO_SOCKET_IFNAME set
to its veth, and joins with `sw.init(backend="gloo")`: every byte between the ranks crosses the shaped link. Rows,
each its own copy of the same seeded GPT with AdamW, the same per-rank batches:
  none                 sw.DDP, fp32 all-reduce of every bucket (default buckets: 1 MiB first, then 25 MiB)
  powersgd             sw.DDP(compression=sw.compression.PowerSGD(rank=--rank, start_iter=--start-iter))
  powersgd_1bucket     the same in one bucket (no overlap with backward: like for like with torch's hook row)
  torch_powersgd_hook  torch DistributedDataParallel + powerSGD_hook (same rank and start iteration), one bucket:
                       with two buckets in flight on gloo the hook's chained all-reduces can be enqueued in
                       different orders on the two ranks (a collective mismatch, seen on this link)
  torch_ddp            torch DistributedDataParallel, its built-in all-reduce, default buckets
Each row first takes --warmup steps (past both PowerSGDs' uncompressed start iterations), then --rounds rounds of
--steps steps of every row, the order rotating every round (shardwise.benchmarks.timing.alternate). A step is forward + backward +
optimizer step; per step the slowest rank counts; rows report the median and deciles, the bytes the kernel counted
leaving this rank's veth per step (TCP/IP included: the real cost, torch's rows too) and, for ours, CommStats' wire
bytes. Ratios: none / powersgd (goal >= 3) and torch_powersgd_hook / powersgd (goal >= 1: ours no slower), per
round and overall. stdout: JSON lines (header with the load average and the link check, one line per row, the
ratios, the load average after); stderr: a table.

    sudo .venv/bin/python bench/compression_netem.py                      # 100 Mbit/s, preset small, 6 rounds
    sudo .venv/bin/python bench/compression_netem.py --rate 1gbit --delay-ms 1 --rounds 10

Needs root, iproute2 and tc; it is a benchmark, not a test (`make test` has the cheap Throttled simulator).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from shardwise.launch.netns import ADDRS, VethPair  # the two hosts: namespaces, veth, 198.18.0.1/.2, shaping

HERE = Path(__file__).resolve().parent
ROWS = ("none", "powersgd", "powersgd_1bucket", "torch_powersgd_hook", "torch_ddp")
ONE_BUCKET_MB = 1024  # larger than the model: one bucket
CHECK_PORT = 29400  # fresh namespaces have no listener: fixed ports cannot collide
MASTER_PORT = 29500


@dataclasses.dataclass(frozen=True)
class Config:
    preset: str
    batch_size: int
    rank: int
    start_iter: int
    steps: int
    rounds: int
    warmup: int
    rows: tuple[str, ...]
    lr: float = 1e-3
    seed: int = 0


# ---- the link (parent, root): shardwise.launch.netns.VethPair -------------------------------------------------


def _check_rate(link: VethPair, nbytes: int, log_dir: Path) -> dict[str, Any]:
    """Send `nbytes` over TCP from namespace 0 to namespace 1 and time it: the shaped link's real throughput."""
    code = ("import socket,sys,time\n"
            "mode,addr,port,n=sys.argv[1],sys.argv[2],int(sys.argv[3]),int(sys.argv[4])\n"
            "if mode=='recv':\n"
            "  s=socket.create_server((addr,port)); c,_=s.accept(); got=0\n"
            "  while got<n:\n"
            "    b=c.recv(1<<20)\n"
            "    if not b: break\n"
            "    got+=len(b)\n"
            "  c.sendall(b'k'); print(got)\n"
            "else:\n"
            "  for _ in range(100):\n"
            "    try: c=socket.create_connection((addr,port)); break\n"
            "    except OSError: time.sleep(0.05)\n"
            "  t=time.perf_counter(); c.sendall(bytes(n)); c.recv(1); print(time.perf_counter()-t)\n")
    recv = link.exec(1, [sys.executable, "-c", code, "recv", ADDRS[1], str(CHECK_PORT), str(nbytes)],
                     env=dict(os.environ), log=log_dir / "check-recv.log", cwd=HERE.parent)
    send = link.exec(0, [sys.executable, "-c", code, "send", ADDRS[1], str(CHECK_PORT), str(nbytes)],
                     env=dict(os.environ), log=log_dir / "check-send.log", cwd=HERE.parent)
    for p in (send, recv):
        p.wait(timeout=120)
    seconds = float((log_dir / "check-send.log").read_text().split()[-1])
    return {"bytes": nbytes, "seconds": round(seconds, 3), "mbit_per_s": round(nbytes * 8 / seconds / 1e6, 1)}


# ---- one rank (inside a namespace) -------------------------------------------------------------------------------
def _tx_bytes(veth: str) -> int:
    # `ip netns exec` mounts this namespace's sysfs: the counter of our end of the link.
    return int(Path(f"/sys/class/net/{veth}/statistics/tx_bytes").read_text())


def _worker(out: Path, cfg: Config, veth: str, timeout: float) -> None:
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import shardwise as sw
    from shardwise.compression import PowerSGD
    from shardwise.models.gpt import GPT

    from shardwise.benchmarks.timing import alternate, bench_corpus, gpt_config

    torch.set_num_threads(1)
    comm = sw.init(backend="gloo", timeout=timeout)
    corpus, gpt = bench_corpus(), gpt_config(cfg.preset)

    class Row:
        def __init__(self, name: str) -> None:
            self.name, self.step_no = name, 0
            self.times: list[float] = []
            self.kernel_bytes: list[int] = []
            self.wire_bytes: list[int] = []
            model = GPT(gpt, seed=cfg.seed)
            self.ours = not name.startswith("torch")
            if self.ours:
                method = PowerSGD(rank=cfg.rank, start_iter=cfg.start_iter) if name != "none" else None
                buckets = ({"bucket_mb": ONE_BUCKET_MB, "first_bucket_mb": ONE_BUCKET_MB}
                           if name == "powersgd_1bucket" else {})
                self.model = sw.DDP(model, comm, compression=method, **buckets)
            elif name == "torch_ddp":
                self.model = TorchDDP(model)
            else:
                # One bucket: the hook issues its second all-reduce from the callback of the first, on gloo's
                # completion thread, so with two buckets in flight the ranks can enqueue bucket 0's Q all-reduce
                # and bucket 1's P all-reduce in different orders: a collective mismatch (seen on this link).
                self.model = TorchDDP(model, bucket_cap_mb=ONE_BUCKET_MB)
                if name == "torch_powersgd_hook":
                    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=cfg.rank,
                                                        start_powerSGD_iter=cfg.start_iter)
                    self.model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr)

        def step(self) -> None:
            x, y = corpus.batch(self.step_no, cfg.batch_size, gpt.seq_len, seed=cfg.seed, rank=comm.rank,
                                world_size=comm.size)
            self.step_no += 1
            before, sent = comm.stats.snapshot(), _tx_bytes(veth)
            t0 = time.perf_counter()
            self.model(x, y).backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.times.append(time.perf_counter() - t0)
            self.kernel_bytes.append(_tx_bytes(veth) - sent)
            self.wire_bytes.append(comm.stats.since(before).wire_bytes())

    rows = [Row(name) for name in cfg.rows]
    for row in rows:
        for _ in range(cfg.warmup):
            row.step()
        for kept in (row.times, row.kernel_bytes, row.wire_bytes):
            kept.clear()
    alternate(rows, cfg.rounds, cfg.steps, Row.step, comm.barrier)
    result = {r.name: {"times": r.times, "kernel_bytes": r.kernel_bytes,
                       "wire_bytes": r.wire_bytes if r.ours else None} for r in rows}
    tmp = out / f"rank{comm.rank}.json.tmp"
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out / f"rank{comm.rank}.json")


# ---- the parent: set up, run, report -----------------------------------------------------------------------------
def _report(cfg: Config, results: list[dict[str, Any]]) -> None:
    from shardwise.benchmarks.timing import emit, max_over_ranks, median, per_round_ratios, step_stats

    per_step = {name: max_over_ranks([r[name]["times"] for r in results]) for name in cfg.rows}
    print(f"{'row':22s} {'median ms':>10s} {'p10':>8s} {'p90':>8s} {'kernel B/step':>14s} {'CommStats B':>12s}",
          file=sys.stderr)
    for name in cfg.rows:
        stats = step_stats(per_step[name])
        kernel = int(median(results[0][name]["kernel_bytes"]))
        wire = results[0][name]["wire_bytes"]
        wire = None if wire is None else int(median(wire))
        emit({"row": name, **stats, "kernel_tx_bytes_per_step": kernel, "commstats_wire_bytes_per_step": wire})
        print(f"{name:22s} {stats['median_ms']:10.1f} {stats['p10_ms']:8.1f} {stats['p90_ms']:8.1f} {kernel:14d} "
              f"{'' if wire is None else wire:>12}", file=sys.stderr)
    for a, b, goal in (("none", "powersgd", ">= 3"), ("torch_powersgd_hook", "powersgd", ">= 1"),
                       ("torch_powersgd_hook", "powersgd_1bucket", ">= 1"), ("torch_ddp", "none", "~1")):
        if a in per_step and b in per_step:
            ratio = median(per_step[a]) / median(per_step[b])
            rounds = per_round_ratios(per_step[a], per_step[b], cfg.steps, cfg.rounds)
            emit({"ratio": f"{a}/{b}", "median": round(ratio, 2), "per_round": [round(r, 2) for r in rounds],
                  "goal": goal})
            print(f"{a}/{b}: {ratio:.2f} (per round {', '.join(f'{r:.2f}' for r in rounds)}; goal {goal})",
                  file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="100mbit", help="the link's rate, in tc's units (100mbit, 1gbit)")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay added by netem (needs sch_netem)")
    p.add_argument("--preset", default="small")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--start-iter", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds the whole run may take")
    p.add_argument("--check-mb", type=float, default=8.0, help="MB sent to measure the link before training")
    p.add_argument("--worker", nargs=3, metavar=("OUT", "VETH", "CONFIG"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        out, veth, config = a.worker
        _worker(Path(out), Config(**{**json.loads(config), "rows": tuple(json.loads(config)["rows"])}), veth,
                a.timeout)
        return
    rows = tuple(r.strip() for r in a.rows.split(",") if r.strip())
    if not rows or any(r not in ROWS for r in rows):
        p.error(f"--rows: {a.rows!r}; allowed a comma list of {list(ROWS)}")
    if a.warmup <= a.start_iter:
        p.error(f"--warmup={a.warmup} must exceed --start-iter={a.start_iter}: the timed steps must compress")
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        p.error("needs root and iproute2's ip and tc (network namespaces, a veth pair and a shaped qdisc)")
    cfg = Config(a.preset, a.batch_size, a.rank, a.start_iter, a.steps, a.rounds, a.warmup, rows)
    from shardwise.benchmarks.timing import emit, loadavg

    link = VethPair(prefix="swb")
    log_dir = Path(tempfile.mkdtemp(prefix="sw-netem-"))
    try:
        link.create()
        link.shape(a.rate, a.delay_ms)
        check = _check_rate(link, int(a.check_mb * 1e6), log_dir)
        emit({"bench": "compression_netem", "config": dataclasses.asdict(cfg), "rate": a.rate,
              "delay_ms": a.delay_ms, "qdisc": link.qdisc, "link_check": check, "loadavg_before": loadavg(),
              "cpus": os.cpu_count()})
        token = secrets.token_hex(16)
        for node, veth in enumerate(link.veth):
            env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "GROUP_RANK")}
            env.update(RANK=str(node), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR=ADDRS[0],
                       MASTER_PORT=str(MASTER_PORT), GLOO_SOCKET_IFNAME=veth, SHARDWISE_JOB_TOKEN=token,
                       OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
            config = json.dumps({**dataclasses.asdict(cfg), "rows": list(rows)})
            link.exec(node, [sys.executable, str(Path(__file__).resolve()), "--timeout", str(a.timeout), "--worker",
                             str(log_dir), veth, config], env=env, log=log_dir / f"rank{node}.log", cwd=HERE.parent)
        deadline = time.monotonic() + a.timeout
        while time.monotonic() < deadline and any(proc.poll() is None for proc in link.procs[-2:]):
            time.sleep(0.5)
        codes = [proc.poll() for proc in link.procs[-2:]]
        if codes != [0, 0]:
            tails = "\n".join(f"--- rank {r} ---\n{(log_dir / f'rank{r}.log').read_text(errors='replace')[-3000:]}"
                              for r in range(2))
            raise SystemExit(f"compression_netem: the ranks ended with {codes} (None: still running at the "
                             f"{a.timeout:g}s deadline)\n{tails}")
        results = [json.loads((log_dir / f"rank{r}.json").read_text()) for r in range(2)]
        _report(cfg, results)
        emit({"loadavg_after": loadavg()})
    finally:
        link.close()
        shutil.rmtree(log_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
