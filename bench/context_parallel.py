"""Benchmark: activation memory per rank under context parallelism (ring and Ulysses) against one process.

Rows (thread ranks; one forward of the GPT on a batch of `--batch-size` sequences of `--seq-len` tokens, each rank
holding T/cp tokens of every sequence as `split_sequence` cuts them, zigzag):

* ``one_process``: the plain GPT (torch's ``scaled_dot_product_attention``) on the whole sequence: the peer.
* ``ring`` / ``ulysses`` at cp = 1, 2, 4: ``context_parallel.apply(model, comm, method=...)``.

Measured: the bytes of every tensor autograd saves for backward during the forward (``saved_tensors_hooks``, via
``shardwise.tensor_parallel.saved_activations``: unique storages, parameters excluded), max over the ranks, and the
share saved inside attention modules. Transient buffers (one block's T/2cp x T/2cp scores in the ring, the incoming
K/V block, Ulysses' gathered q, k, v) are freed before the next layer and are not counted; they are printed as
``transient_bytes`` from the formula. Each row prints ``ratio`` = its bytes / the one-process bytes. A parity line
checks that every row's loss (mean over ranks) equals the one-process loss.

stdout carries JSON lines only; a summary goes to stderr.

    .venv/bin/python bench/context_parallel.py                       # d_model 128, 8 heads, 2 layers, T 1024
    .venv/bin/python bench/context_parallel.py --seq-len 256 --cp 1,2  # smoke run
"""

from __future__ import annotations

import argparse
import sys

import torch
from _common import comma_list, emit

import shardwise as sw
from shardwise import context_parallel as cp
from shardwise.data import ByteCorpus
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.tensor_parallel import saved_activations


def measure(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int, int]:
    """(loss, saved bytes, of which inside attention modules) of one forward, then its backward (a real step)."""
    with saved_activations(model) as saved:
        loss = model(x, y)
    loss.backward()
    attention = sum(b for name, b in saved.by_module.items() if name.endswith(".attn"))
    return loss.item(), saved.total, attention


def rank_body(comm, config: GPTConfig, x: torch.Tensor, y: torch.Tensor, method: str) -> tuple[float, int, int]:
    model = cp.apply(GPT(config, seed=0), comm, method=method)
    xr, yr = cp.split_sequence((x, y), comm)
    return measure(model, xr, yr)


def transient_bytes(config: GPTConfig, batch: int, seq: int, n: int, method: str) -> int:
    """Largest per-layer buffer freed before the next layer (fp32): a ring block's scores plus the incoming K/V,
    or Ulysses' gathered q, k, v and output for H/cp heads."""
    elt, heads, hd = 4, config.n_heads, config.head_dim
    if method == "ring":
        c = seq // (2 * n)
        return elt * batch * heads * (c * c + 2 * 2 * (seq // n) * hd)
    return elt * batch * (heads // n) * 4 * seq * hd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--n-heads", type=int, default=8)
    parser.add_argument("--n-layers", type=int, default=2)
    parser.add_argument("--cp", type=comma_list, default=[1, 2, 4], help="context-parallel sizes, e.g. 1,2,4")
    args = parser.parse_args()
    config = GPTConfig(vocab_size=256, seq_len=args.seq_len, d_model=args.d_model, n_heads=args.n_heads,
                       n_layers=args.n_layers)
    x, y = ByteCorpus(max_bytes=200_000).batch(0, args.batch_size, args.seq_len)
    torch.set_num_threads(1)

    base_loss, base, base_attn = measure(GPT(config, seed=0), x, y)
    emit({"row": "one_process", "seq_len": args.seq_len, "batch": args.batch_size, "saved_bytes": base,
          "attention_bytes": base_attn, "ratio": 1.0, "loss": base_loss})
    print(f"one process: {base / 2**20:.2f} MiB saved for backward (attention {base_attn / 2**20:.2f} MiB)",
          file=sys.stderr)
    worst = 0.0
    for method in cp.METHODS:
        for n in args.cp:
            results = sw.launch(rank_body, n, config, x, y, method)
            saved = max(r[1] for r in results)
            attn = max(r[2] for r in results)
            loss = sum(r[0] for r in results) / n
            worst = max(worst, abs(loss - base_loss))
            emit({"row": method, "cp": n, "seq_len": args.seq_len, "saved_bytes": saved, "attention_bytes": attn,
                  "ratio": round(saved / base, 4), "transient_bytes": transient_bytes(config, args.batch_size,
                                                                                      args.seq_len, n, method),
                  "loss": loss})
            print(f"{method:8s} cp={n}: {saved / 2**20:.2f} MiB per rank = {saved / base:.3f} x one process "
                  f"(attention {attn / 2**20:.2f} MiB)", file=sys.stderr)
    emit({"parity": "loss", "max_abs_diff": worst})


if __name__ == "__main__":
    main()
