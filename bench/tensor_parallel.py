"""Benchmark: shardwise tensor parallel (TP=2) against PyTorch DTensor tensor parallel and one process, on gloo (CPU).

Rows (every TP rank trains on the same full batch of `--batch-size` sequences; AdamW fp32; a step is forward +
backward + optimizer step + zero_grad, timed on every rank, max over ranks per step, median over all measured steps):

* ``shardwise_gpt``: ``tp.parallelize(model, comm, plan="gpt")``: blocks split Megatron style, tied embedding / head
  split by vocabulary, vocabulary-parallel cross-entropy. The headline row.
* ``shardwise_blocks``: a dict plan that splits only the blocks (qkv / fc colwise, proj rowwise), leaving the
  embedding, head and loss replicated: the same layout as the DTensor row, for a like-for-like comparison.
* ``shardwise_gpt_sp``: plan "gpt" with sequence_parallel=True.
* ``dtensor``: ``parallelize_module(block, init_device_mesh("cpu", (2,)), {"attn.qkv": ColwiseParallel(),
  "attn.proj": RowwiseParallel(), "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()})`` per block.
  DTensor splits qkv contiguously, so its qkv rows are permuted first (rank r's contiguous chunk = [q_r | k_r | v_r],
  whole heads; the same model up to that permutation), otherwise rank 0 would get q and half of k.
* ``single_process_1t`` / ``single_process_2t``: plain PyTorch, one process with 1 / 2 threads (the TP rows use 2
  processes x 1 thread), run separately afterwards, not alternated (context only).

Each row also reports ``cpu_ms``: the median CPU time a step consumed (``time.process_time()``, every thread of the
process, gloo's included; max over ranks). Wall time on a shared machine mostly measures how long the two ranks
wait to be scheduled at each collective; CPU time is far less sensitive to that, so its ratio is printed as well.

The TP rows run in the SAME gloo processes (`shardwise.launch(..., backend="gloo", threads_per_rank=1)`) and
ALTERNATE: after warm-up, `--rounds` rounds of `--steps` steps of each (order rotating), so slow phases of a noisy
machine hit all of them alike. Parity: after training, every row's parameters (gathered to full tensors with the
original names; DTensor's qkv un-permuted) are compared with shardwise_gpt's, and every row's loss at a few steps is
printed (all rows train the same model on the same batches). ``--memory`` adds one line of
activation bytes saved for backward per rank (tp 1 / 2 / 4, with and without sequence parallel; thread ranks), of
the GPT preset and of a small HuggingFace Llama and Mixtral (plan "llama"; under sequence parallel Mixtral's MoE
blocks run on the whole sequence).

stdout carries JSON lines only (one per row, a parity line, optionally a memory line, then the ratio line); the
human-readable summary goes to stderr.

    .venv/bin/python bench/tensor_parallel.py                  # bench preset, batch 8, 5 rounds x 5 steps
    .venv/bin/python bench/tensor_parallel.py --rounds 3 --memory
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time
from typing import Any

import torch

import shardwise
from shardwise import tensor_parallel as tp
from shardwise.data import ByteCorpus
from shardwise.models.gpt import GPT, GPTConfig

from shardwise.benchmarks.timing import alternate, bench_corpus, emit, max_over_ranks, step_stats

GOAL = 0.8  # the target: shardwise step time <= 0.8 x DTensor's
BLOCK_PLAN = {"blocks.*.attn.qkv": tp.Colwise(fused=3), "blocks.*.attn.proj": "rowwise",
              "blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise"}


@dataclasses.dataclass(frozen=True)
class Config:
    preset: str
    batch_size: int
    steps: int
    rounds: int
    warmup: int
    nproc: int
    lr: float = 1e-3
    seed: int = 0


class _Impl:
    def __init__(self, name: str, model: torch.nn.Module, lr: float, gather: Any) -> None:
        self.name, self.model, self.gather = name, model, gather
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr)
        self.step_no = 0
        self.times: list[list[float]] = []
        self.losses: list[float] = []


def _step(impl: _Impl, corpus: ByteCorpus, cfg: Config, seq_len: int) -> list[float]:
    x, y = corpus.batch(impl.step_no, cfg.batch_size, seq_len, seed=cfg.seed)  # the same full batch on every rank
    impl.step_no += 1
    c0 = time.process_time()
    t0 = time.perf_counter()
    loss = impl.model(x, y)
    t1 = time.perf_counter()
    impl.losses.append(loss.item())
    loss.backward()
    t2 = time.perf_counter()
    impl.opt.step()
    impl.opt.zero_grad(set_to_none=True)
    t3 = time.perf_counter()
    return [t3 - t0, t1 - t0, t2 - t1, t3 - t2, time.process_time() - c0]


def _qkv_permutation(n_heads_blocks: int, width: int, world: int) -> torch.Tensor:
    """Row order that makes rank r's contiguous chunk of a [q | k | v] weight equal [q_r | k_r | v_r]."""
    return torch.arange(n_heads_blocks * width).view(n_heads_blocks, world, width // world).transpose(0, 1).reshape(-1)


def _dtensor_model(mcfg: GPTConfig, cfg: Config, world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = GPT(mcfg, seed=cfg.seed)
    perm = _qkv_permutation(3, mcfg.d_model, world)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight.copy_(block.attn.qkv.weight[perm])
            if block.attn.qkv.bias is not None:
                block.attn.qkv.bias.copy_(block.attn.qkv.bias[perm])
    mesh = init_device_mesh("cpu", (world,))  # over the default group shardwise.launch initialised
    for block in model.blocks:
        parallelize_module(block, mesh, {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                                         "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()})
    return model


def _dtensor_state(model: torch.nn.Module, world: int, d: int) -> dict[str, torch.Tensor]:
    inverse = torch.argsort(_qkv_permutation(3, d, world))
    out = {}
    for name, value in model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[name] = full[inverse] if ".attn.qkv." in name else full.detach().clone()
    return out


def _rank_main(comm: shardwise.Communicator, cfg: Config) -> dict[str, Any]:
    corpus = bench_corpus()
    mcfg = GPTConfig.preset(cfg.preset)
    world = comm.size
    impls = [
        _Impl("shardwise_gpt", tp.parallelize(GPT(mcfg, seed=cfg.seed), comm, "gpt"), cfg.lr, tp.full_state_dict),
        _Impl("shardwise_blocks", tp.parallelize(GPT(mcfg, seed=cfg.seed), comm, BLOCK_PLAN), cfg.lr,
              tp.full_state_dict),
        _Impl("shardwise_gpt_sp", tp.parallelize(GPT(mcfg, seed=cfg.seed), comm, "gpt", sequence_parallel=True),
              cfg.lr, tp.full_state_dict),
        _Impl("dtensor", _dtensor_model(mcfg, cfg, world), cfg.lr, lambda m: _dtensor_state(m, world, mcfg.d_model)),
    ]
    for impl in impls:
        for _ in range(cfg.warmup):
            _step(impl, corpus, cfg, mcfg.seq_len)
    alternate(impls, cfg.rounds, cfg.steps, lambda impl: impl.times.append(_step(impl, corpus, cfg, mcfg.seq_len)),
              comm.barrier)
    states = {impl.name: impl.gather(impl.model) for impl in impls}
    ref = states["shardwise_gpt"]
    parity = {name: max((s[k] - ref[k]).abs().max().item() for k in ref) for name, s in states.items()
              if name != "shardwise_gpt"}
    losses = {i.name: [round(v, 5) for v in i.losses[:: max(1, len(i.losses) // 4)] + i.losses[-1:]] for i in impls}
    return {"times": {i.name: i.times for i in impls}, "parity": parity, "losses": losses,
            "trained_steps": impls[0].step_no}


def _baseline_main(comm: shardwise.Communicator, cfg: Config) -> list[float]:
    corpus = bench_corpus()
    mcfg = GPTConfig.preset(cfg.preset)
    impl = _Impl("single_process", GPT(mcfg, seed=cfg.seed), cfg.lr, None)
    for _ in range(cfg.warmup):
        _step(impl, corpus, cfg, mcfg.seq_len)
    return [_step(impl, corpus, cfg, mcfg.seq_len)[0] for _ in range(cfg.rounds * cfg.steps)]


def _memory_rank(comm: shardwise.Communicator, preset: str, batch: int, sp: bool) -> int:
    model = tp.parallelize(GPT(GPTConfig.preset(preset), seed=0), comm, "gpt", sequence_parallel=sp)
    x = torch.randint(0, 256, (batch, model.config.seq_len), generator=torch.Generator().manual_seed(0))
    with tp.saved_activations(model) as saved:
        model(x, x)
    return saved.total


def _hf_llama() -> torch.nn.Module:
    """A small HuggingFace Llama (d=256, 4 layers, 8 query / 4 key-value heads, vocabulary 1024, T=128)."""
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=256, attn_implementation="sdpa"))


def _hf_mixtral() -> torch.nn.Module:
    """The same sizes as a Mixtral: 4 experts of 688 hidden features, 2 per token (plan "llama" keeps them whole)."""
    import transformers

    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2,
        attn_implementation="sdpa", experts_implementation="eager"))


def _memory_rank_hf(comm: shardwise.Communicator, base: torch.nn.Module, batch: int, sp: bool) -> int:
    model = copy.deepcopy(base)
    if comm.size > 1:
        model = tp.parallelize(model, comm, "llama", sequence_parallel=sp)
    x = torch.randint(0, 1024, (batch, 128), generator=torch.Generator().manual_seed(0))
    with tp.saved_activations(model) as saved:
        model(input_ids=x, labels=x)
    return saved.total


def _memory(cfg: Config) -> dict[str, Any]:
    out: dict[str, Any] = {"what": "activation bytes saved for backward per rank, one forward (thread ranks)",
                           "preset": cfg.preset, "batch_size": cfg.batch_size}
    llama, mixtral = _hf_llama(), _hf_mixtral()
    for n in (1, 2, 4):
        for sp in (False, True) if n > 1 else (False,):
            key = f"tp{n}" + ("_sp" if sp else "")
            out[key] = shardwise.launch(_memory_rank, n, cfg.preset, cfg.batch_size, sp)[0]
            out[f"hf_llama_{key}"] = shardwise.launch(_memory_rank_hf, n, llama, cfg.batch_size, sp)[0]
            out[f"hf_mixtral_{key}"] = shardwise.launch(_memory_rank_hf, n, mixtral, cfg.batch_size, sp)[0]
    return out


def _summary(name: str, totals: list[float], sections: list[list[float]] | None, note: str = "") -> dict[str, Any]:
    row = {"name": name, **step_stats(totals, sections, ("fwd_ms", "bwd_ms", "opt_ms", "cpu_ms"))}
    if note:
        row["note"] = note
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=5, help="measured steps per implementation per round (default 5)")
    ap.add_argument("--rounds", type=int, default=5, help="alternation rounds (default 5)")
    ap.add_argument("--warmup", type=int, default=3, help="unmeasured steps of each implementation first (default 3)")
    ap.add_argument("--preset", default="bench", help="GPT preset: tiny | small | bench (default bench)")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per step, the same on every rank (default 8)")
    ap.add_argument("--nproc", type=int, default=2, help="tensor-parallel gloo processes, 1 thread each (default 2)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the single-process baselines")
    ap.add_argument("--memory", action="store_true", help="also measure activation memory with and without SP")
    args = ap.parse_args(argv)
    if args.nproc < 2:
        ap.error("--nproc must be >= 2")
    if min(args.steps, args.rounds) < 1 or args.warmup < 0:
        ap.error("--steps and --rounds must be >= 1, --warmup >= 0")
    cfg = Config(args.preset, args.batch_size, args.steps, args.rounds, args.warmup, args.nproc)
    nparams = GPT(GPTConfig.preset(cfg.preset), seed=0).num_parameters()

    t0 = time.time()
    results = shardwise.launch(_rank_main, cfg.nproc, cfg, backend="gloo", threads_per_rank=1, timeout=600)
    rows = []
    for name in results[0]["times"]:
        steps = max_over_ranks([r["times"][name] for r in results])  # per step: [total, fwd, bwd, opt, cpu]
        rows.append(_summary(name, [s[0] for s in steps], [s[1:] for s in steps]))
    if not args.no_baseline:
        for threads in (1, 2):
            base = shardwise.launch(_baseline_main, 1, cfg, backend="gloo", threads_per_rank=threads, timeout=600)[0]
            rows.append(_summary(f"single_process_{threads}t", base, None, "separate run, not alternated"))
    for row in rows:
        row.update(preset=cfg.preset, params=nparams, nproc=cfg.nproc, batch_size=cfg.batch_size)
        emit(row)
    parity = {name: max(r["parity"][name] for r in results) for name in results[0]["parity"]}
    # Parameters drift apart slowly (AdamW's default eps=1e-8 amplifies rounding noise of near-zero gradients, e.g.
    # the attention key bias); the losses along the way show the rows train the same model.
    emit({"parity_max_abs_diff_vs_shardwise_gpt": parity, "losses": results[0]["losses"],
          "trained_steps": results[0]["trained_steps"]})
    if args.memory:
        emit({"memory": _memory(cfg)})

    by_name = {r["name"]: r for r in rows}
    dt_ms = by_name["dtensor"]["median_ms"]
    ratios = {r["name"]: round(r["median_ms"] / dt_ms, 3) for r in rows if r["name"] != "dtensor"}
    ratio = by_name["shardwise_gpt"]["median_ms"] / dt_ms
    cpu_ratios = {r["name"]: round(r["cpu_ms"] / by_name["dtensor"]["cpu_ms"], 3) for r in rows
                  if "cpu_ms" in r and r["name"] != "dtensor"}
    emit({"ratio": round(ratio, 3), "shardwise": "shardwise_gpt", "cpu_ratio": cpu_ratios["shardwise_gpt"],
          "shardwise_median_ms": by_name["shardwise_gpt"]["median_ms"], "dtensor_median_ms": dt_ms, "goal": GOAL,
          "meets_goal": ratio <= GOAL, "all_ratios_vs_dtensor": ratios, "all_cpu_ratios_vs_dtensor": cpu_ratios,
          "wall_s": round(time.time() - t0, 1)})

    err = sys.stderr
    print(f"\nTP step time, {cfg.preset} GPT ({nparams / 1e6:.2f} M params), TP={cfg.nproc} gloo ranks x 1 thread, "
          f"batch {cfg.batch_size} (same on every rank), {cfg.rounds} rounds x {cfg.steps} steps alternating:",
          file=err)
    for r in rows:
        extra = (f"  fwd {r['fwd_ms']:.0f} / bwd {r['bwd_ms']:.0f} / opt {r['opt_ms']:.0f}, cpu {r['cpu_ms']:.0f}"
                 if "fwd_ms" in r else "")
        print(f"  {r['name']:<20} median {r['median_ms']:8.1f} ms  (p10 {r['p10_ms']:.1f}, p90 {r['p90_ms']:.1f}, "
              f"n={r['steps']}){extra}", file=err)
    print(f"  ratio shardwise_gpt / dtensor = {ratio:.3f}  (goal <= {GOAL}: {'met' if ratio <= GOAL else 'NOT met'}); "
          f"CPU-time ratio {cpu_ratios['shardwise_gpt']:.3f}; parity max|diff| = {max(parity.values()):.2e}", file=err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
