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

``--mode overlap`` times ring attention instead (rows alternate in the same run: after ``--warmup`` calls of each,
``--rounds`` rounds of ``--steps`` calls of each row, order rotating; per call the slowest rank; medians). One call
is the forward and backward of causal attention on q, k, v of shape (batch, heads, T, d_model / heads), fp32, with
``torch.set_num_threads(1)`` (process-wide: one intra-op thread per rank):

* ``ring_overlap`` at cp = 2 (``--cp``): ``ring_attention`` as shipped: each K/V (and, backward, dK/dV) transfer is
  posted before the block's compute and waited for after it.
* ``ring_serial``: the same code, but every transfer is waited for right after it is posted, before any compute
  (no overlap): ring_attention runs over a communicator wrapper that waits for each ``batch_isend_irecv`` as soon
  as it is posted; the row checks that the wrapper waited on every exchange.
* ``one_rank_ring``: ``ring_attention`` on a group of one over the whole sequence (the same block code, no
  transfers), run by rank 0 while the others wait; ``one_rank_sdpa``: torch's ``scaled_dot_product_attention``
  (is_causal) on the whole sequence, rank 0 alone.

It also prints the bytes each rank sent per call (CommStats' ``send``) against the ring formula (forward
(cp-1) x |K|+|V|, backward (cp-1) x |K|+|V| + cp x |dK|+|dV|), the largest difference of the ring rows' outputs and
gradients from torch's attention, and the load average. On thread ranks a send is a memory copy made by the
sender when it is posted (buffered), so there is nothing to overlap but the wait for the slower peer; with
``--backend gloo`` (one process per rank, one thread each) transfers go through gloo's loopback transport.

stdout carries JSON lines only; a summary goes to stderr.

    .venv/bin/python bench/context_parallel.py                       # d_model 128, 8 heads, 2 layers, T 1024
    .venv/bin/python bench/context_parallel.py --seq-len 256 --cp 1,2  # smoke run
    .venv/bin/python bench/context_parallel.py --mode overlap --seq-len 2048   # ring overlap at cp = 2
    .venv/bin/python bench/context_parallel.py --mode overlap --seq-len 256 --rounds 2 --steps 2   # smoke run
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from shardwise.benchmarks.timing import alternate, comma_list, emit, loadavg, max_over_ranks, median, per_round_ratios, step_stats

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


# ---- --mode overlap: ring attention's time per forward + backward ----------------------------------------------
class _WaitAtOnce:
    """ring_serial's communicator: `comm` itself, except that every batch of point-to-point transfers (ring.py posts
    each K/V, dK/dV exchange as one `batch_isend_irecv`) is waited for as soon as it is posted, before the caller
    computes anything, and counted. ring_attention takes it like any communicator (public means: nothing of ring.py
    is swapped)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.waited = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def batch_isend_irecv(self, ops: list) -> list:
        for work in self.inner.batch_isend_irecv(ops):
            work.wait()
        self.waited += 1
        return []


def _ring_kv_bytes(batch: int, heads: int, local_len: int, head_dim: int) -> int:
    return 2 * batch * heads * local_len * head_dim * 4  # K and V, fp32


def overlap_rank(comm, qkv: torch.Tensor, do: torch.Tensor, want: dict[str, torch.Tensor],  # noqa: ANN001
                 steps: int, rounds: int, warmup: int) -> dict[str, Any]:
    """One rank of --mode overlap: the rows of the module docstring, alternating; returns times, bytes, errors."""
    torch.set_num_threads(1)
    serial_comm = _WaitAtOnce(comm)
    n = comm.size
    solo = comm.split(comm.rank)  # a group of one per rank, for the one-rank ring row
    pos = cp.SequenceSplit(n).positions(comm.rank, qkv.shape[3] // n)
    local_qkv, local_do = qkv[:, :, :, pos].contiguous(), do[:, :, pos].contiguous()

    def ring(serial: bool, q, k, v, g):  # noqa: ANN001, ANN202
        out = cp.ring_attention(q, k, v, serial_comm if serial else comm)
        out.backward(g)
        return out

    def one_rank_ring(q, k, v, g):  # noqa: ANN001, ANN202
        out = cp.ring_attention(q, k, v, solo)
        out.backward(g)
        return out

    def sdpa(q, k, v, g):  # noqa: ANN001, ANN202
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(g)
        return out

    rows = {"ring_overlap": (lambda *a: ring(False, *a), True), "ring_serial": (lambda *a: ring(True, *a), True),
            "one_rank_ring": (one_rank_ring, False), "one_rank_sdpa": (sdpa, False)}
    times: dict[str, list[float]] = {name: [] for name in rows}
    sent: dict[str, list[int]] = {name: [] for name in rows}

    def call(name: str, measured: bool) -> tuple[torch.Tensor, ...] | None:
        fn, everyone = rows[name]
        if not everyone and comm.rank != 0:
            if measured:
                times[name].append(0.0)  # the max over ranks is rank 0's time
            return None
        source, g = (local_qkv, local_do) if everyone else (qkv, do)
        q, k, v = (t.detach().clone().requires_grad_() for t in source)
        t0 = time.perf_counter()
        with comm.stats.measure() as counted:
            out = fn(q, k, v, g)
        if measured:
            times[name].append(time.perf_counter() - t0)
            sent[name].append(counted.bytes("send"))
        return out.detach(), q.grad, k.grad, v.grad

    errors = {}
    for name in rows:
        comm.barrier()
        for _ in range(warmup):
            call(name, measured=False)
        got = call(name, measured=False)  # an unmeasured call, checked against torch's attention
        if got is not None:
            ref = (want["out"], *want["grads"]) if not rows[name][1] else \
                (want["out"][:, :, pos], *(g[:, :, pos] for g in want["grads"]))
            errors[name] = max((a - b).abs().max().item() for a, b in zip(got, ref))
    serial_before = serial_comm.waited
    alternate(list(rows), rounds, steps, lambda name: call(name, measured=True), comm.barrier)
    return {"times": times, "sent": sent, "errors": errors, "serial_waits": serial_comm.waited - serial_before}


def overlap_main(args: argparse.Namespace, sizes: list[int]) -> None:
    """--mode overlap: per cp size, one launch alternating the rows; JSON lines on stdout, a summary on stderr."""
    if args.d_model % args.n_heads:
        raise SystemExit(f"--d-model {args.d_model} must be divisible by --n-heads {args.n_heads}")
    B, H, T, D = args.batch_size, args.n_heads, args.seq_len, args.d_model // args.n_heads
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(3, B, H, T, D, generator=gen)
    do = torch.randn(B, H, T, D, generator=gen)
    q, k, v = (t.clone().requires_grad_() for t in qkv)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # the reference for the error line
    out.backward(do)
    want = {"out": out.detach(), "grads": (q.grad, k.grad, v.grad)}
    emit({"mode": "overlap", "backend": args.backend, "batch": B, "heads": H, "seq_len": T, "head_dim": D,
          "cp": sizes, "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup, "torch_threads": 1,
          "loadavg": loadavg()})
    for n in sizes:
        if T % (2 * n):
            raise SystemExit(f"--seq-len {T} must be a multiple of 2 x cp = {2 * n} (zigzag)")
        load_start = loadavg()
        kw = {"backend": "gloo", "threads_per_rank": 1} if args.backend == "gloo" else {}
        results = sw.launch(overlap_rank, n, qkv, do, want, args.steps, args.rounds, args.warmup, timeout=600, **kw)
        per_call = {name: max_over_ranks([r["times"][name] for r in results]) for name in results[0]["times"]}
        rows = {name: {"row": name, "cp": n if name.startswith("ring") else 1, **step_stats(ts)}
                for name, ts in per_call.items()}
        kv = _ring_kv_bytes(B, H, T // n, D)
        formula = (n - 1) * kv + (n - 1) * kv + n * kv
        for name in ("ring_overlap", "ring_serial"):
            sent = [b for r in results for b in r["sent"][name]]
            rows[name].update(sent_bytes_per_rank=max(sent), sent_formula=formula,
                              sent_ratio=round(max(sent) / formula, 6) if formula else None,
                              sent_exact=all(b == formula for b in sent))
        # Per rank and call the ring posts cp-1 exchanges forward, cp-1 (K/V) + cp (dK/dV) backward: the serial row
        # must have waited at once on every one of them, or it measured the overlapped code.
        waits = sum(r["serial_waits"] for r in results) / (n * args.rounds * args.steps)
        if waits != 3 * n - 2:
            raise SystemExit(f"ring_serial waited at once on {waits} exchanges per rank and call, not {3 * n - 2}: "
                             f"ring.py no longer posts its transfers through batch_isend_irecv; the row is not serial")
        rows["ring_serial"]["serial_waits_per_rank_call"] = waits
        errors = {name: max(r["errors"].get(name, 0.0) for r in results) for name in rows}
        for name, row in rows.items():
            row.update(seq_len=T, max_abs_error_vs_torch=errors[name], backend=args.backend)
            emit(row)

        def ratio(a: str, b: str) -> dict[str, float]:
            paired = per_round_ratios(per_call[a], per_call[b], args.steps, args.rounds)
            return {"ratio": round(rows[a]["median_ms"] / rows[b]["median_ms"], 3), "paired": round(median(paired), 3)}

        ratios = {"ring_overlap/ring_serial": ratio("ring_overlap", "ring_serial"),
                  "ring_overlap/one_rank_ring": ratio("ring_overlap", "one_rank_ring"),
                  "ring_overlap/one_rank_sdpa": ratio("ring_overlap", "one_rank_sdpa")}
        emit({"ratios": ratios, "cp": n, "loadavg_start": load_start, "loadavg_end": loadavg()})
        print(f"\nring attention forward + backward, cp={n} ({args.backend} ranks x 1 thread), B={B} H={H} T={T} "
              f"D={D}, {args.rounds} rounds x {args.steps} calls alternating, load average {load_start} -> "
              f"{loadavg()}:", file=sys.stderr)
        for row in rows.values():
            print(f"  {row['row']:<14} median {row['median_ms']:8.2f} ms  (p10 {row['p10_ms']:.2f}, p90 "
                  f"{row['p90_ms']:.2f}, n={row['steps']}), max |error| vs torch {row['max_abs_error_vs_torch']:.1e}",
                  file=sys.stderr)
        print(f"  sent per rank and call {rows['ring_overlap']['sent_bytes_per_rank']:,} B (formula {formula:,}); "
              + "; ".join(f"{k} {v['ratio']} (paired {v['paired']})" for k, v in ratios.items()), file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("memory", "overlap"), default="memory",
                        help="memory: activation bytes per rank (default); overlap: ring attention time")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--n-heads", type=int, default=8)
    parser.add_argument("--n-layers", type=int, default=2)
    parser.add_argument("--cp", type=lambda s: comma_list(s, int), default=None,
                        help="context-parallel sizes, e.g. 1,2,4 (default 1,2,4; overlap mode: 2, sizes >= 2 only)")
    parser.add_argument("--steps", type=int, default=5, help="overlap: measured calls per row per round (5)")
    parser.add_argument("--rounds", type=int, default=5, help="overlap: alternation rounds (5)")
    parser.add_argument("--warmup", type=int, default=2, help="overlap: unmeasured calls of each row first (2)")
    parser.add_argument("--backend", choices=("thread", "gloo"), default="thread", help="overlap: the ranks")
    args = parser.parse_args()
    if args.mode == "overlap":
        sizes = [n for n in (args.cp or [2]) if n >= 2]
        if not sizes or min(args.steps, args.rounds) < 1 or args.warmup < 0:
            parser.error("overlap: --cp needs a size >= 2, --steps and --rounds >= 1, --warmup >= 0")
        overlap_main(args, sizes)
        return
    args.cp = args.cp or [1, 2, 4]
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
