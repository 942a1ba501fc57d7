"""What parameters that look like the model's cost: one optimizer step over ShardedParameter pieces, beside plain
tensors (the floor: no wrapper at all) and FSDP2's representation (DTensor), on the bench GPT's tensors.

Under ZeRO / FSDP every piece a rank trains is a `shardwise.sharded_tensor.ShardedParameter` (its gradient a
ShardedTensor): the storage is the plain piece, so torch's kernels run unchanged, and a Python `__torch_function__`
runs once per torch call that touches one (it decides elementwise / refuse, docs/sharding.md). The only place that
costs anything is where the optimizer calls torch on the pieces: its step. This script times exactly that, in one
process, for the three representations holding the same elements (each tensor whole, so the three rows move the same
bytes and differ only in the per-call overhead): torch's default AdamW (a for-loop of per-tensor calls on CPU) and
AdamW(foreach=True) (one call per group of tensors, torch's default on CUDA). Alternating rounds, the order rotating;
medians over every step of a row; the load average at the end.

    .venv/bin/python bench/sharded_params.py                       # bench preset, 10 rounds x 5 steps
    .venv/bin/python bench/sharded_params.py --preset small --rounds 20

Prints JSON lines: one per (optimizer, representation) with median_ms, p10/p90, ratio to plain, and the overhead per
tensor per step in microseconds; then a summary line with the load average.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
from torch import nn

from shardwise.benchmarks.timing import emit, gpt_config, loadavg, rotations, step_stats
from shardwise.models.gpt import GPT
from shardwise.sharded_tensor import ShardSpec, as_sharded

IMPLS = ("plain", "sharded", "dtensor")


def _dtensor_mesh():
    """A one-rank gloo process group and mesh for DTensor (FSDP2's parameter type), or None when unavailable."""
    import torch.distributed as dist  # the peer's own machinery, as bench's peers use it (shardwise.benchmarks)
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return init_device_mesh("cpu", (1,))


def make_params(impl: str, shapes: list[tuple[str, torch.Size]], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, shape in shapes:
        value, grad = torch.randn(shape, generator=g), torch.randn(shape, generator=g) * 1e-2
        if impl == "plain":
            p = nn.Parameter(value.reshape(-1))
            p.grad = grad.reshape(-1)
        elif impl == "sharded":
            spec = ShardSpec(shape, name)
            p = as_sharded(value.reshape(-1), spec, parameter=True, requires_grad=True)
            p.grad = as_sharded(grad.reshape(-1), spec)
        else:
            from torch.distributed.tensor import Shard, distribute_tensor

            mesh = _dtensor_mesh()
            p = nn.Parameter(distribute_tensor(value, mesh, [Shard(0)]))
            p.grad = distribute_tensor(grad, mesh, [Shard(0)])
        out.append(p)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="bench")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma list of {IMPLS}")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shapes = [(n, p.shape) for n, p in GPT(gpt_config(args.preset), seed=0).named_parameters()]
    impls = [i for i in args.impls.split(",") if i]
    optimizers = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1),
                  "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1, foreach=True)}
    for opt_name, make in optimizers.items():
        opts = {impl: make(make_params(impl, shapes, 0)) for impl in impls}
        for opt in opts.values():
            opt.step()  # state allocated outside the timing
        times: dict[str, list[float]] = {impl: [] for impl in impls}
        for order in rotations(impls, args.rounds):
            for impl in order:
                for _ in range(args.steps):
                    t = time.perf_counter()
                    opts[impl].step()
                    times[impl].append(time.perf_counter() - t)
        plain = step_stats(times["plain"])["median_ms"] if "plain" in times else None
        for impl in impls:
            row = {"optimizer": opt_name, "impl": impl, "tensors": len(shapes),
                   "elements": sum(s.numel() for _, s in shapes), **step_stats(times[impl])}
            if plain:
                row["ratio_to_plain"] = round(row["median_ms"] / plain, 3)
                row["overhead_us_per_tensor"] = round((row["median_ms"] - plain) * 1e3 / len(shapes), 1)
            emit(row)
    emit({"summary": True, "preset": args.preset, "rounds": args.rounds, "steps": args.steps, "loadavg": loadavg(),
          "torch": torch.__version__})


if __name__ == "__main__":
    main()
