"""Benchmark: the sharding engine's memory options measured against `sw.estimate_memory` (issue 13, deliver 5).

Two tables, each row a measurement beside the estimate for the same configuration (no timing: valid on a loaded
machine):

* **Activation checkpointing** (`activation_checkpointing=False | k | True`, ZeRO-3 over 2 thread ranks, the GPT
  of `--preset` at `--seq-len` x `--batch-size` per rank): the bytes autograd keeps for backward after the forward
  (`sw.tensor_parallel.saved_activations`: unique storages, parameters excluded), against `estimate_memory(...,
  activation_checkpointing=ac, attention="fused")` (Korthikanti et al. 2022: sbh x 34 per layer, 2sbh per
  checkpointed layer, plus the fp32 logits; the GPT uses fused attention). The estimate's "one layer recomputed
  at a time" term is transient in backward and is printed separately: the kept bytes are compared without it.
* **CPU offload** (`cpu_offload=False | "optimizer" | "full"`, ZeRO-1/2/3, AdamW fp32, after one step):
  `sw.memory_stats(model, opt)`'s device model states and host bytes against the estimate's device model states
  and `cpu`.

stdout: JSON lines (one per row, then a summary); stderr: the tables.

    .venv/bin/python bench/engine_memory.py
    .venv/bin/python bench/engine_memory.py --preset small --seq-len 256
"""

from __future__ import annotations

import argparse
import sys

import torch

import shardwise as sw
from shardwise.models.gpt import GPT, Block, GPTConfig
from shardwise.tensor_parallel import saved_activations

from shardwise.benchmarks.timing import emit, loadavg

WORLD = 2


def _batch(cfg: GPTConfig, seq_len: int, batch_size: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, cfg.vocab_size, (batch_size, seq_len + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _kept_activations(comm, cfg: GPTConfig, seq_len: int, batch_size: int, ac) -> int:
    model = sw.ZeRO(GPT(cfg, seed=0), comm, stage=3, wrap=Block, activation_checkpointing=ac)
    x, y = _batch(cfg, seq_len, batch_size, comm.rank)
    with saved_activations(model) as saved:
        loss = model(x, y)
    loss.backward()
    return saved.total


def _model_states(comm, cfg: GPTConfig, stage: int, offload) -> dict[str, int]:
    model = sw.ZeRO(GPT(cfg, seed=0), comm, stage=stage, wrap=Block, cpu_offload=offload)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = _batch(cfg, 32, 2, comm.rank)
    model(x, y).backward()
    opt.step()  # optimizer state exists from here; the .grad shards stay (no zero_grad): the ZeRO formulas count them
    stats = sw.memory_stats(model, opt)
    return {"device": stats.device_model_states, "host": stats.host}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="bench", help="GPT preset: tiny | small | bench (default bench)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per rank (default 8)")
    args = ap.parse_args()
    cfg = GPTConfig.preset(args.preset)
    psi_model = GPT(cfg, seed=0)
    emit({"load_average": loadavg(), "preset": args.preset, "params": sum(p.numel() for p in psi_model.parameters()),
          "world": WORLD})

    print(f"activation checkpointing, ZeRO-3 over {WORLD} ranks, {args.preset} GPT, s={args.seq_len} "
          f"b={args.batch_size} per rank (MB kept for backward after forward)", file=sys.stderr)
    print(f"  {'ac':>6} {'measured':>10} {'estimate':>10} {'ratio':>7} {'+recompute':>11}", file=sys.stderr)
    for ac in (False, 2, True):
        kept = max(sw.launch(_kept_activations, WORLD, cfg, args.seq_len, args.batch_size, ac))
        est = sw.estimate_memory(psi_model, "zero3", WORLD, mixed_precision=False, seq_len=args.seq_len,
                                 batch_size=args.batch_size, activation_checkpointing=ac, attention="fused")
        recompute = 0.0
        if ac:  # the estimate's transient term: one layer's full activations while it is recomputed
            with_ac = est.activations
            layer = (sw.estimate_memory(psi_model, "zero3", WORLD, mixed_precision=False, seq_len=args.seq_len,
                                        batch_size=args.batch_size, num_layers=1, vocab_size=1,
                                        attention="fused").activations or 0.0)
            recompute = layer - 4 * args.seq_len * args.batch_size * 1  # minus the 1-word "vocabulary" logits
            kept_estimate = with_ac - recompute
        else:
            kept_estimate = est.activations
        ratio = kept / kept_estimate
        emit({"table": "activation_checkpointing", "ac": ac, "measured_bytes": kept, "estimate_bytes": kept_estimate,
              "recompute_bytes": recompute, "ratio": round(ratio, 3)})
        print(f"  {str(ac):>6} {kept / 1e6:10.2f} {kept_estimate / 1e6:10.2f} {ratio:7.3f} {recompute / 1e6:11.2f}",
              file=sys.stderr)

    print(f"CPU offload, AdamW fp32, {WORLD} ranks (MB per rank: device model states / host)", file=sys.stderr)
    print(f"  {'stage':>5} {'offload':>9} {'device':>8} {'est.':>8} {'host':>8} {'est.':>8}", file=sys.stderr)
    for stage in (1, 2, 3):
        for offload in (False, "optimizer", "full"):
            got = sw.launch(_model_states, WORLD, cfg, stage, offload)[0]
            level = {False: None, "optimizer": "optimizer", "full": "full"}[offload]
            if level == "full" and stage < 3:
                level = "optimizer"  # ZeRO-1/2 compute with whole parameters: "full" places what "optimizer" does
            est = sw.estimate_memory(psi_model, f"zero{stage}", WORLD, mixed_precision=False, cpu_offload=level)
            emit({"table": "cpu_offload", "stage": stage, "offload": offload, "device_bytes": got["device"],
                  "estimate_device_bytes": est.model_states, "host_bytes": got["host"], "estimate_host_bytes": est.cpu})
            print(f"  {stage:>5} {str(offload):>9} {got['device'] / 1e6:8.2f} {est.model_states / 1e6:8.2f} "
                  f"{got['host'] / 1e6:8.2f} {est.cpu / 1e6:8.2f}", file=sys.stderr)


if __name__ == "__main__":
    main()
