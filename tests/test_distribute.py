"""`sw.distribute`: parity of every strategy string with one process, "auto" choosing ZeRO-3 when memory_gb rules
out DDP (and every rank agreeing), the explanation, bad input, and a torchrun job of 2 gloo processes."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from parity import ATOL, CONFIG, RTOL, batch
from ports import free_port

import shardwise as sw
from shardwise.models import GPT, GPTConfig
from shardwise.planner import Links, Workload, candidates, estimate

STEPS = 3
GB = 1e9


def _optimizer(params, eps: float) -> torch.optim.Optimizer:
    # eps 1e-5 under tensor parallel (tests/compose_cases.py says why), 1e-6 otherwise (tests/parity.py)
    return torch.optim.AdamW(params, lr=1e-3, eps=eps)


def _reference(eps: float) -> dict[str, torch.Tensor]:
    model = GPT(CONFIG, seed=0)
    opt = _optimizer(model.parameters(), eps)
    for step in range(STEPS):
        x, y = batch(step)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(comm, strategy, eps, options):
    model = sw.distribute(GPT(CONFIG, seed=0), comm, strategy, **options)
    opt = _optimizer(model.parameters(), eps)
    for step in range(STEPS):
        x, y = batch(step, model.plan.data_rank, model.plan.data_world)  # this rank's slice of the global batch
        if isinstance(model, sw.HybridModel):
            model.step(x, y)
        else:
            model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return model.plan.strategy, sw.full_state_dict(model)


CASES = [  # (strategy, world size, options)
    ("ddp", 2, {}), ("zero1", 2, {}), ("zero2", 2, {}), ("zero3", 2, {}), ("fsdp", 2, {}),
    ("fsdp:full_shard", 2, {}), ("fsdp:shard_grad_op", 2, {}), ("fsdp:no_shard", 2, {}),
    ("fsdp:hybrid_shard", 4, {"shard_size": 2}), ("deepspeed_stage_3", 2, {}), ("tp", 2, {}),
    ("3d:dp=2,tp=1,pp=2,dp_strategy=zero1", 4, {}), ("3d:dp=2,tp=2,pp=2", 8, {}),
]


@pytest.mark.parametrize("strategy, world, options", CASES, ids=[c[0] for c in CASES])
def test_every_strategy_string_matches_one_process(strategy, world, options):
    tensor_parallel = strategy == "tp" or "tp=2" in strategy
    eps = 1e-5 if tensor_parallel else 1e-6
    want = _reference(eps)
    results = sw.launch(lambda comm: _train(comm, strategy, eps, options), world, backend="thread", timeout=120)
    for rank, (chosen, state) in enumerate(results):
        assert chosen == sw.planner.parse_strategy(strategy, world, shard_size=options.get("shard_size")).strategy
        assert state.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(state[name], want[name], rtol=RTOL, atol=1e-5 if tensor_parallel else ATOL,
                                       msg=lambda m: f"{strategy} rank {rank} {name}: {m}")


# A model deep enough that ZeRO-3's two gathered layers stay below ZeRO-2's whole parameters.
DEEP = GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_heads=4, n_layers=8)


def _memory_between_zero3_and_the_rest(world: int) -> float:
    """memory_gb where ZeRO-3 fits and every faster data-parallel layout does not, from the planner's own figures."""
    psi = sum(p.numel() for p in GPT(DEEP, seed=0).parameters())
    work, links = Workload(psi, "fp32", hidden_size=DEEP.d_model), Links(world, world)
    est = {c.label: estimate(c, work, links) for c in candidates(world, world, tensor_parallel=False,
                                                                   pipeline=False, offload=False)}
    smallest_other = min(e.device for label, e in est.items() if label != "zero3")
    assert est["zero3"].device < smallest_other, "the test model must make ZeRO-3 the only fit"
    return (est["zero3"].device + smallest_other) / 2 / 0.9 / GB


def test_auto_picks_zero3_when_memory_rules_out_ddp_and_explains_why():
    world = 4
    memory_gb = _memory_between_zero3_and_the_rest(world)

    def body(comm):
        model = sw.distribute(GPT(DEEP, seed=0), comm, memory_gb=memory_gb)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = DEEP_BATCH
        rows = x.shape[0] // model.plan.data_world
        mine = slice(model.plan.data_rank * rows, (model.plan.data_rank + 1) * rows)
        loss = model(x[mine], y[mine])
        loss.backward()
        opt.step()
        return model.plan.strategy, model.plan.plan.explain(), float(loss.detach())

    results = sw.launch(body, world, backend="thread", timeout=120)
    assert {r[0] for r in results} == {"zero3"}  # every rank made the same choice
    assert len({r[1] for r in results}) == 1  # the same plan, figure for figure
    text = results[0][1]
    assert "Chosen: zero3." in text
    assert "Faster layouts do not fit" in text and "ddp needs" in text and "zero2 needs" in text
    assert f"{world} ranks, {world} per node" in text and "fp32" in text
    # CPU ranks are planned with gloo's loopback figure, not the GPU links the planner assumes on a device
    assert "Links: 1 GB/s within a node" in text and "CPU ranks over gloo" in text, text
    assert all(torch.isfinite(torch.tensor(r[2])) for r in results)


DEEP_BATCH = batch(0)


def test_a_world_of_one_without_a_communicator_calls_init(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    model = sw.distribute(GPT(CONFIG, seed=0))
    assert model.plan.strategy == "ddp" and model.plan.data_world == 1
    assert "1 rank, 1 per node" in model.plan.explain()


def _raises_on_every_rank(world, match, **kwargs):
    def body(comm):
        with pytest.raises(ValueError, match=match):
            sw.distribute(GPT(CONFIG, seed=0), comm, **kwargs)
        return True

    assert all(sw.launch(body, world, backend="thread", timeout=60))


@pytest.mark.parametrize("kwargs, match", [
    (dict(strategy="zero4"), r"strategy='zero4' is not known; allowed .*'fsdp:hybrid_shard'.*'auto'"),
    (dict(strategy="3d:dp=2,tp=3"), r"tp x pp = 3 x 1 = 3 does not divide the world size 2"),
    (dict(strategy="fsdp:hybrid_shard", shard_size=3), r"shard_size, a positive int dividing the world size 2"),
    (dict(bucket=25), r"unknown option\(s\) \['bucket'\]; allowed .*'bucket_mb'"),
    (dict(optimizer="lion"), r"optimizer='lion' is not known"),
    (dict(memory_gb=-1), r"memory_gb=-1 must be a positive number"),
    (dict(memory_gb=0.0006), r"no strategy fits .* the smallest world size that would fit is \d+ ranks"),
])
def test_bad_input_raises_naming_the_argument(kwargs, match):
    _raises_on_every_rank(2, match, **kwargs)


def test_bad_model_and_comm():
    with pytest.raises(ValueError, match="model must be a torch.nn.Module"):
        sw.distribute("gpt")
    with pytest.raises(ValueError, match="comm_or_mesh must be a shardwise Communicator, a Mesh or None"):
        sw.distribute(GPT(CONFIG, seed=0), comm_or_mesh=3)


_TORCHRUN_SCRIPT = """
import torch
import shardwise as sw
from shardwise.data import ByteCorpus
from shardwise.models import GPT, GPTConfig

config = GPTConfig.preset("tiny")
model = sw.distribute(GPT(config, seed=0))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
corpus = ByteCorpus(max_bytes=100_000)
losses = []
for step in range(4):
    x, y = corpus.batch(step, 4, config.seq_len, rank=model.plan.data_rank, world_size=model.plan.data_world)
    loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(round(float(loss), 4))
print(f"RESULT rank={torch.distributed.get_rank()} strategy={model.plan.strategy} losses={losses}", flush=True)
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_distribute_with_no_argument_trains_under_torchrun(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_TORCHRUN_SCRIPT))
    port = free_port()  # for the rendezvous
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(port), str(script)],
        capture_output=True, text=True, timeout=280, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Two processes share the pipe, so one's line may land inside the other's: find the records, not the lines.
    found = sorted(re.findall(r"RESULT rank=(\d+) strategy=(\S+) losses=(\[[^\]]*\])", proc.stdout))
    assert [rank for rank, _, _ in found] == ["0", "1"], proc.stdout
    assert len({strategy for _, strategy, _ in found}) == 1, found  # both ranks distributed the same way
    losses = [ast.literal_eval(text) for _, _, text in found]
    assert losses[0][-1] < losses[0][0]  # it trains
    assert "sw.distribute over 2 ranks" in proc.stderr and "Chosen: " in proc.stderr  # rank 0 logged the plan


# shard_grad_op's estimate is its peak inside a step (parameters gathered from forward through backward, as ZeRO-2);
# between steps, where memory_stats looks, its parameters are sharded as ZeRO-3's.
AT_REST = [("ddp", "ddp"), ("zero1", "zero1"), ("zero2", "zero2"), ("zero3", "zero3"), ("fsdp", "fsdp"),
           ("fsdp:shard_grad_op", "zero3")]


@pytest.mark.parametrize("strategy, formula", AT_REST, ids=[s for s, _ in AT_REST])
def test_memory_stats_of_the_demo_model_within_5_percent_of_the_estimate(strategy, formula):
    """What a rank holds after a step (parameters, gradients, AdamW state) against sw.estimate_memory's formula."""
    world, config = 4, GPTConfig.preset("small")  # the demo's model

    def body(comm):
        model = sw.distribute(GPT(config, seed=0), comm, strategy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randint(0, config.vocab_size, (2, config.seq_len))
        model(x, x).backward()
        opt.step()  # AdamW's state exists from the first step; the gradients are still held
        return sw.memory_stats(model, opt).model_states

    want = sw.estimate_memory(GPT(config, seed=0), formula, world, mixed_precision=False).total
    for rank, got in enumerate(sw.launch(body, world, backend="thread", timeout=120)):
        assert got == pytest.approx(want, rel=0.05), f"{strategy} rank {rank}: {got} bytes, estimate {want:.0f}"


def test_strategy_tp_with_a_mesh_of_another_shape_is_refused_not_ignored():
    """strategy='tp' splits every layer over the whole world: given a dp2 x tp2 mesh it used to build tp=4 and
    silently drop the mesh the caller passed."""

    def body(comm):
        with pytest.raises(ValueError, match=r"strategy='tp' splits every layer over all 4 ranks"):
            sw.distribute(GPT(GPTConfig.preset("tiny"), seed=0), sw.Mesh(comm, dp=2, tp=2), "tp", memory_gb=10)
        return True

    assert all(sw.launch(body, 4))
