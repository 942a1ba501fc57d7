"""Tensor parallel composed with data parallel (DDP, ZeRO-1/2/3, FSDP), with and without sequence parallel, gives
the single-process model's numbers: gradient norms, clipped training, full state dicts, memory statistics.

Each case builds a dp x tp Mesh on thread ranks, splits the tiny GPT over mesh.tp (the plan "gpt"), wraps it with
the data-parallel strategy over mesh.dp, and trains 5 AdamW steps with clipping at a max-norm that binds (the test
checks that it does). Every dp rank feeds its slice of the global batch; the reference is one process on the
whole batch. AdamW's eps is 1e-5, as in the tensor-parallel tests (see tests/test_tensor_parallel_gpt.py for why).
"""

from __future__ import annotations

import pytest
import torch
from parity import CONFIG, RTOL, batch
from sharding_cases import wrap

import shardwise as sw
from shardwise.sharded_tensor import local
from shardwise import layout
from shardwise import tensor_parallel as tp
from shardwise.models import GPT

STEPS = 5
MAX_NORM = 0.3
EPS = 1e-5
ATOL_TP = 1e-5


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3, eps=EPS)


def dense(steps=STEPS):
    model = GPT(CONFIG, seed=0)
    opt = optimizer(model.parameters())
    norms = []
    for step in range(steps):
        x, y = batch(step)
        model(x, y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def composed(comm, dp, dp_strategy, sp, steps=STEPS):
    mesh = sw.Mesh(comm, dp=dp, tp=comm.size // dp)
    model = tp.parallelize(GPT(CONFIG, seed=0), mesh.tp, "gpt", sequence_parallel=sp)
    if dp_strategy == "ddp":
        model = sw.DDP(model, mesh.dp)
    elif dp_strategy is not None:
        model = wrap(model, mesh.dp, dp_strategy)
    opt = optimizer(model.parameters())
    norms = []
    for step in range(steps):
        x, y = batch(step, mesh.coords.dp, dp)
        model(x, y).backward()
        norms.append(float(sw.clip_grad_norm_(model, MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return sw.full_state_dict(model), norms, [r.name for r in layout.strategies(model)]


@pytest.fixture(scope="module")
def reference():
    return dense()


CASES = [
    (2, 1, None, False), (2, 1, None, True), (4, 2, "ddp", False), (4, 2, "ddp", True),
    (4, 2, "zero1", True), (4, 2, "zero2", True), (4, 2, "zero3", False), (4, 2, "zero3", True),
    (4, 2, "hybrid_shard1", True),
]


@pytest.mark.parametrize("world, dp, dp_strategy, sp", CASES,
                         ids=[f"tp{w // d}-dp{d}-{s or 'none'}{'-sp' if sp else ''}" for w, d, s, sp in CASES])
def test_clipped_training_matches_one_process(world, dp, dp_strategy, sp, reference):
    want, want_norms = reference
    assert min(want_norms) > MAX_NORM  # clipping binds at every step
    for state, norms, names in sw.launch(composed, world, dp, dp_strategy, sp):
        assert names[0] == "tensor_parallel" and len(names) == (1 if dp_strategy is None else 2)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(want_norms), rtol=RTOL, atol=0)
        assert state.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(state[name], want[name], rtol=RTOL, atol=ATOL_TP, msg=lambda m: f"{name}: {m}")


def test_placements_describe_tensor_parallel_and_zero():
    """The declared placements: TP boxes of the dense tensor, ZeRO flat ranges within them, replicated groups."""

    def body(comm):
        mesh = sw.Mesh(comm, dp=2, tp=2)
        model = wrap(tp.parallelize(GPT(CONFIG, seed=0), mesh.tp, "gpt", sequence_parallel=True), mesh.dp, "zero3")
        pls = layout.placements(model)
        qkv, ln, tied = pls["blocks.0.attn.qkv.weight"], pls["blocks.0.ln1.weight"], pls["tok_emb.weight"]
        d = CONFIG.d_model
        per = d // 2
        assert qkv.shape == (3 * d, d) and qkv.box_group is mesh.tp and qkv.flat_group is mesh.dp
        assert qkv.boxes == tuple(((k * d + mesh.coords.tp * per, per), (0, d)) for k in range(3))
        lo, hi = qkv.flat
        assert hi - lo == local(qkv.param).numel() and sum(h - l for l, h in qkv.flat_by_rank) == 3 * per * d
        assert qkv.param.shape == (3 * d, d)  # the piece answers for the original tensor (sharded_tensor.py)
        assert ln.boxes is None and mesh.tp in ln.replicated_over and ln.partial_grad_over is mesh.tp
        assert tied.names == ("tok_emb.weight", "head.weight")
        assert layout.reduction_groups(model) == [mesh.tp, mesh.dp]
        with pytest.raises(ValueError, match="pass comm="):
            layout.model_world(model, "save_checkpoint")
        with pytest.raises(ValueError, match=r"already wrapped by a data-parallel strategy \(tensor_parallel \+ zero3\)"):
            sw.DDP(model, mesh.dp)
        stats = sw.memory_stats(model)
        held = sum(local(p).numel() for p in model.parameters()) * 4
        assert stats.params >= held and stats.gathered_peak > 0

    sw.launch(body, 4)


def test_tensor_parallel_after_data_parallel_is_refused():
    def body(comm):
        model = sw.DDP(GPT(CONFIG, seed=0), comm)
        with pytest.raises(ValueError, match=r"already wrapped \(ddp\); apply tensor parallel to the plain model first"):
            tp.parallelize(model, comm, "gpt")

    sw.launch(body, 2)


def test_grad_scaler_over_the_model_skips_on_every_rank():
    """fp16-style overflow on one tp x dp rank's shard: a scaler built from the model skips the step everywhere."""

    def body(comm):
        mesh = sw.Mesh(comm, dp=2, tp=2)
        model = wrap(tp.parallelize(GPT(CONFIG, seed=0), mesh.tp, "gpt"), mesh.dp, "zero2")
        opt = optimizer(model.parameters())
        scaler = sw.ShardedGradScaler(model, init_scale=4.0)
        x, y = batch(0, mesh.coords.dp, 2)
        scaler.scale(model(x, y)).backward()
        if comm.rank == 3:
            next(local(p.grad) for p in model.parameters() if p.grad is not None and local(p.grad).numel())[0] = \
                float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        took = scaler.step(opt)
        scaler.update()
        assert not took and scaler.get_scale() == 2.0
        assert all(torch.equal(local(a), local(p)) for a, p in zip(before, model.parameters()))

    sw.launch(body, 4)
