"""Benchmark: the CPU cost of one PowerSGD reduction, ours against torch's `powerSGD_hook`, on the same bucket.

Once PowerSGD has cut the bytes (38x on the demo GPT), its encode/decode is what is left of the step's communication
cost, so this isolates it: one process, a gloo group of ONE (the all-reduces return at once: no wire, no peer), the
demo GPT's whole gradient in one bucket (parameters in reverse order, as DDP packs them), rank --rank. Each call
refills the bucket from the same random gradient, then reduces it: ours `PowerSGD.reduce(...).wait()`, torch's
`powerSGD_hook(state, bucket).wait()` (given a stand-in for DDP's GradBucket: buffer(), index(), gradients(),
is_last(), what the hook calls) with its error feedback and warm start on, past its start iteration. Both compress
the same matrices (the same min_compression_rate rule). `copy_only` is the refill alone. Rows alternate in blocks of
--steps calls, the order rotating every round (shardwise.benchmarks.timing.rotations); medians of the process's CPU time (all its
threads: torch's hook runs its later stages as future callbacks, possibly on gloo's thread; less moved by other jobs
than wall time) and of wall time. stdout: JSON lines with the load average; stderr: a table.

    .venv/bin/python bench/compression_cpu.py                # preset small, rank 4
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

import shardwise as sw
from shardwise.compression import PowerSGD
from shardwise.models.gpt import GPT

from shardwise.benchmarks.timing import emit, gpt_config, loadavg, median, rotations


class _Bucket:
    """What powerSGD_hook reads of DDP's GradBucket: the flat buffer and the per-parameter views into it."""

    def __init__(self, buffer: torch.Tensor, shapes: list[torch.Size]) -> None:
        self._buffer, self._views, offset = buffer, [], 0
        for shape in shapes:
            self._views.append(buffer[offset : offset + shape.numel()].view(shape))
            offset += shape.numel()

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True

    def gradients(self) -> list[torch.Tensor]:
        return self._views


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--steps", type=int, default=5, help="calls per row per round")
    p.add_argument("--rounds", type=int, default=10)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    with socket.socket() as s:  # a free port for the group of one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        comm = sw.init(backend="gloo")  # wraps the group above
        shapes = [q.shape for q in reversed(list(GPT(gpt_config(a.preset), seed=0).parameters()))]
        numel = sum(s.numel() for s in shapes)
        grad = torch.randn(numel, generator=torch.Generator().manual_seed(0))
        flat = torch.empty(numel)
        ours = PowerSGD(rank=a.rank, start_iter=0).fresh()
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=a.rank,
                                            start_powerSGD_iter=2)
        state.iter = state.start_powerSGD_iter  # compressing from the first call, like ours with start_iter=0
        bucket = _Bucket(flat, shapes)

        def run_ours() -> None:
            flat.copy_(grad)
            ours.reduce(0, flat, comm, shapes).wait()

        def run_torch() -> None:
            flat.copy_(grad)
            powerSGD_hook.powerSGD_hook(state, bucket).wait()

        rows = {"copy_only": lambda: flat.copy_(grad), "ours": run_ours, "torch_powersgd_hook": run_torch}
        emit({"bench": "compression_cpu", "preset": a.preset, "rank": a.rank, "numel": numel,
              "loadavg_before": loadavg()})
        for fn in rows.values():  # first calls allocate buffers and draw Q: not timed
            for _ in range(3):
                fn()
        cpu: dict[str, list[float]] = {k: [] for k in rows}
        wall: dict[str, list[float]] = {k: [] for k in rows}
        for order in rotations(list(rows), a.rounds):
            for name in order:
                for _ in range(a.steps):
                    c, w = time.process_time(), time.perf_counter()
                    rows[name]()
                    cpu[name].append(time.process_time() - c)
                    wall[name].append(time.perf_counter() - w)
        print(f"{'row':22s} {'cpu ms':>8s} {'wall ms':>8s}", file=sys.stderr)
        for name in rows:
            c, w = median(cpu[name]) * 1e3, median(wall[name]) * 1e3
            emit({"row": name, "cpu_median_ms": round(c, 2), "wall_median_ms": round(w, 2), "calls": len(cpu[name])})
            print(f"{name:22s} {c:8.2f} {w:8.2f}", file=sys.stderr)
        ratio = median(cpu["torch_powersgd_hook"]) / median(cpu["ours"])
        emit({"ratio": "torch_powersgd_hook/ours (cpu)", "median": round(ratio, 2), "goal": ">= 1"})
        print(f"torch_powersgd_hook / ours (cpu): {ratio:.2f} (goal >= 1)", file=sys.stderr)
        emit({"loadavg_after": loadavg()})
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
