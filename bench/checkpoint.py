"""Checkpoint save/load time and bytes: shardwise sharded checkpoints against torch.save of a gathered full state.

Both sides save the same thing: the model (ZeRO-3 over N gloo processes) and its AdamW state after one step.
* shardwise: `save_checkpoint` (each rank writes its shard; fsync; atomic rename) and `load_checkpoint`.
* peer: gather the full model state dict and the full optimizer state (`sw.full_state_dict`,
  `sw.full_optimizer_state_dict`), `torch.save` it on rank 0 to one file (fsync for a fair comparison), and
  `torch.load` + `sw.load_full_state_dict` / `sw.load_full_optimizer_state_dict` on every rank (what people do
  without a sharded format).
Runs alternate, median of --repeats. Prints JSON lines.

    .venv/bin/python bench/checkpoint.py --nproc 2 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

import shardwise as sw
from shardwise.checkpoint import read_tensors
from shardwise.models import GPT, GPTConfig

from shardwise.benchmarks.timing import emit, median


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def body(comm, root: str, repeats: int, preset: str, verify: bool) -> dict:
    model = sw.ZeRO(GPT(GPTConfig.preset(preset), seed=0), comm, stage=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (2, GPTConfig.preset(preset).seq_len))  # the preset's context length
    model(x, x).backward()
    opt.step()
    opt.zero_grad()
    times = {"shardwise_save": [], "shardwise_load": [], "torch_save": [], "torch_load": [], "gather": []}
    sizes = {}
    for r in range(repeats):
        target = Path(root) / f"sw-{r}"
        comm.barrier()
        t0 = time.perf_counter()
        sw.save_checkpoint(target, model, opt, step=r)
        times["shardwise_save"].append(time.perf_counter() - t0)
        sizes["shardwise"] = _dir_bytes(target)
        comm.barrier()
        t0 = time.perf_counter()
        sw.load_checkpoint(target, model, opt, verify=verify)
        comm.barrier()
        times["shardwise_load"].append(time.perf_counter() - t0)

        peer = Path(root) / f"torch-{r}.pt"
        comm.barrier()
        t0 = time.perf_counter()
        state = {"model": sw.full_state_dict(model), "optim": sw.full_optimizer_state_dict(model, opt)}
        times["gather"].append(time.perf_counter() - t0)
        if comm.rank == 0:
            with open(peer, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
        comm.barrier()
        times["torch_save"].append(time.perf_counter() - t0)
        sizes["torch"] = peer.stat().st_size
        t0 = time.perf_counter()
        loaded = torch.load(peer, weights_only=True)
        sw.load_full_state_dict(model, loaded["model"])
        sw.load_full_optimizer_state_dict(model, opt, loaded["optim"])
        comm.barrier()
        times["torch_load"].append(time.perf_counter() - t0)
        if comm.rank == 0:
            shutil.rmtree(target)
            peer.unlink()
    # Sanity: the sharded checkpoint holds exactly the model's parameters.
    sw.save_checkpoint(Path(root) / "check", model, opt, step=0)
    if comm.rank == 0:
        saved = read_tensors(Path(root) / "check")
        same = all(torch.equal(saved[f"param/{k}"], v) for k, v in sw.full_state_dict(model).items()
                   if f"param/{k}" in saved)
    else:
        sw.full_state_dict(model)
        same = True
    return {"times": times, "sizes": sizes, "same": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--preset", default="bench")
    parser.add_argument("--no-verify", action="store_true", help="skip the sha256 check on load (the peer has none)")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="shardwise-ckpt-bench-")
    try:
        result = sw.launch(body, args.nproc, root, args.repeats, args.preset, not args.no_verify, backend="gloo", timeout=300,
                           threads_per_rank=1)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    medians = {k: median(v) * 1000 for k, v in result["times"].items()}
    for impl in ("shardwise", "torch"):
        emit({"impl": impl, "save_ms": round(medians[f"{impl}_save"], 1), "load_ms": round(medians[f"{impl}_load"], 1),
              "bytes": result["sizes"][impl], "nproc": args.nproc, "preset": args.preset, "repeats": args.repeats,
              "verify": not args.no_verify})
    emit({"gather_ms": round(medians["gather"], 1), "what": "sw.full_state_dict + sw.full_optimizer_state_dict, "
          "inside torch save"})
    emit({"save_ratio": round(medians["shardwise_save"] / medians["torch_save"], 3),
          "load_ratio": round(medians["shardwise_load"] / medians["torch_load"], 3),
          "parameters_identical": result["same"]})


if __name__ == "__main__":
    main()
