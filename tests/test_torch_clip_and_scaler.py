"""torch.nn.utils.clip_grad_norm_ and torch.amp.GradScaler over a sharded model: whole tensors' figures.

A training script's `torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)` was refused under ZeRO / FSDP /
tensor parallel (taken per piece it would clip each rank by its own pieces' norm, and the replicas would step
apart); FSDP2's DTensor gradients let torch's clip run. Now it runs too: every norm, the total it returns and the
training after it (AdamW with weight decay, a binding clip) are one process's, under ZeRO-1/2/3, FSDP's hybrid
shard, tensor parallel with ZeRO-3 over it, expert parallel under DDP and ZeRO-3, for the orders 2, 3 and inf,
with and without the foreach kernels, and through `get_total_norm` + `clip_grads_with_norm_`.
"""

from __future__ import annotations

import functools
import threading

import expert_cases
import pytest
import torch
from parity import CONFIG, assert_state_close, batch
from torch import nn

import shardwise as sw
from shardwise import tensor_parallel as tp
from shardwise.experts import expert_parallel
from shardwise.models import GPT

_lock = threading.Lock()
MAX_NORM = 0.05  # binding at every step


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 12)
        self.lin = nn.Linear(12, 12)
        self.head = nn.Linear(12, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.lin(self.emb(ids))))


def built() -> Net:
    with _lock, torch.random.fork_rng():
        torch.manual_seed(0)
        return Net()


def _total_then_clip(model: nn.Module) -> torch.Tensor:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), MAX_NORM, total)
    return total


CLIPS = {
    "l2": lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM),
    "l2_per_tensor": lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM, foreach=False),
    "l3": lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM, norm_type=3),
    "inf": lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM, norm_type="inf"),
    "total_then_clip": _total_then_clip,
}
WRAPS = {
    "zero1": lambda m, c: sw.ZeRO(m, c, stage=1),
    "zero2": lambda m, c: sw.ZeRO(m, c, stage=2),
    "zero3": lambda m, c: sw.ZeRO(m, c, stage=3),
    "zero3_units": lambda m, c: sw.ZeRO(m, c, stage=3, wrap=(nn.Linear, nn.Embedding)),
    "fsdp_hybrid": lambda m, c: sw.FSDP(m, c, sharding="hybrid_shard", shard_size=2, wrap=(nn.Linear,)),
}


def train(model: nn.Module, clip, rank: int, world: int, optimizer=None) -> tuple[list[float], dict]:
    opt = (optimizer(model.parameters()) if optimizer is not None
           else torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-5))
    norms = []
    for step in range(3):
        g = torch.Generator().manual_seed(10 + step)
        ids, y = torch.randint(0, 10, (12,), generator=g), torch.randn(12, 3, generator=g)
        rows = slice(rank * 12 // world, (rank + 1) * 12 // world)
        ((model(ids[rows]) - y[rows]) ** 2).mean().backward()
        norms.append(float(clip(model)))
        opt.step()
        opt.zero_grad()
    return norms, {k: v.clone() for k, v in sw.full_state_dict(model).items()}


@pytest.mark.parametrize("wrap,clip", [*((w, "l2") for w in WRAPS), *(("zero3", c) for c in CLIPS if c != "l2"),
                                       ("fsdp_hybrid", "inf")])
def test_torch_clip_of_pieces_is_one_process_clip(wrap, clip):
    want_norms, want = train(built(), CLIPS[clip], 0, 1)
    assert min(want_norms) > MAX_NORM  # the clip binds

    def body(comm):
        return train(WRAPS[wrap](built(), comm), CLIPS[clip], comm.rank, comm.size)

    for norms, state in sw.launch(body, 4):
        torch.testing.assert_close(norms, want_norms, rtol=1e-6, atol=0)
        assert_state_close(state, want)


def test_torch_clip_under_tensor_parallel_and_zero3():
    """GPT column, row, fused-QKV and vocabulary slices (tp 2) under ZeRO-3 over dp 2, LayerNorms replicated over
    tp: torch's clip returns one process's norm and trains as one process does."""

    def steps(model, rank, world):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-5)
        norms = []
        for step in range(3):
            model(*batch(step, rank, world)).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)))
            opt.step()
            opt.zero_grad()
        return norms, {k: v.clone() for k, v in sw.full_state_dict(model).items()}

    want_norms, want = steps(GPT(CONFIG, seed=0), 0, 1)
    assert min(want_norms) > 0.3

    def body(comm):
        mesh = sw.Mesh(comm, dp=2, tp=2)
        model = sw.ZeRO(tp.parallelize(GPT(CONFIG, seed=0), mesh.tp, "gpt"), mesh.dp, stage=3)
        return steps(model, mesh.coords.dp, 2)

    for norms, state in sw.launch(body, 4):
        torch.testing.assert_close(norms, want_norms, rtol=1e-5, atol=0)
        for key in want:
            torch.testing.assert_close(state[key], want[key], rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")


@functools.lru_cache(maxsize=1)
def _moe_one_process():
    return expert_cases.one_process()


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_torch_clip_under_expert_parallel(strategy):
    """A MoE GPT's experts split over ep 2 (edp 2), under DDP or ZeRO-3 over dp 4: torch's clip is one process's."""
    want, _, want_norms, _ = _moe_one_process()

    def body(comm):
        mesh = sw.Mesh(comm, ep=2)
        model = expert_parallel(GPT(expert_cases.CFG, seed=0), mesh)
        model = sw.DDP(model, mesh.dp) if strategy == "ddp" else sw.ZeRO(model, mesh.dp, stage=3)
        _, norms, _ = expert_cases.train(model, lambda step: expert_cases.batch(step, mesh.coords.dp, mesh.dp.size),
                                         lambda m, n: torch.nn.utils.clip_grad_norm_(m.parameters(), n))
        return norms, sw.full_state_dict(model)

    for norms, state in sw.launch(body, 4):
        torch.testing.assert_close(norms, want_norms, rtol=1e-5, atol=0)
        for key in want:
            torch.testing.assert_close(state[key], want[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")


def train_scaled(model: nn.Module, rank: int, world: int) -> tuple[list[float], dict]:
    """torch.amp.GradScaler as a mixed-precision script uses it: scale, backward, unscale_, torch's clip, step,
    update; at step 1 one gradient element is inf (on whichever rank holds it), so that step must be skipped."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scales = []
    for step in range(3):
        g = torch.Generator().manual_seed(10 + step)
        ids, y = torch.randint(0, 10, (12,), generator=g), torch.randn(12, 3, generator=g)
        rows = slice(rank * 12 // world, (rank + 1) * 12 // world)
        scaler.scale(((model(ids[rows]) - y[rows]) ** 2).mean()).backward()
        if step == 1:
            with torch.no_grad():
                model.lin.weight.grad[5, 7] = float("inf")  # written where it lies (docs/sharding.md)
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales, {k: v.clone() for k, v in sw.full_state_dict(model).items()}


@pytest.mark.parametrize("wrap", ["zero2", "zero3", "fsdp_hybrid"])
def test_torch_grad_scaler_skips_together(wrap):
    """One rank's piece overflows: every rank skips the step and backs the scale off, as one process does (each
    rank deciding alone would step the others and leave the replicas apart)."""
    want_scales, want = train_scaled(built(), 0, 1)
    assert want_scales[1] == want_scales[0] / 2  # the step with the inf was skipped

    def body(comm):
        return train_scaled(WRAPS[wrap](built(), comm), comm.rank, comm.size)

    for scales, state in sw.launch(body, 4):
        assert scales == want_scales
        assert_state_close(state, want)


def test_a_parameters_norm_is_whole_without_grad_and_refused_with_it():
    """`torch.linalg.vector_norm(p)` of a piece under no_grad is the whole tensor's; with autograd recording it would
    have no gradient (a regulariser added to the loss), so it raises naming where to compute it."""
    want = float(torch.linalg.vector_norm(built().lin.weight.detach()))

    def body(comm):
        model = sw.ZeRO(built(), comm, stage=3)
        with pytest.raises(RuntimeError, match=r"linalg_vector_norm\(\) on lin.weight"):
            torch.linalg.vector_norm(model.lin.weight)
        with pytest.raises(RuntimeError, match=r"torch.linalg.vector_norm\(p\) \(and torch's clip_grad_norm_\) take "
                                               r"the whole tensor's norm"):
            model.lin.weight.norm()
        with torch.no_grad():
            return float(torch.linalg.vector_norm(model.lin.weight))

    assert sw.launch(body, 2) == [pytest.approx(want, rel=1e-6)] * 2


class LARS(torch.optim.Optimizer):
    """SGD with a layer-wise trust ratio (You et al. 2017, arXiv 1708.03888), norms by torch.linalg.vector_norm."""

    def __init__(self, params, lr=0.1, eta=0.001, weight_decay=1e-4):
        super().__init__(params, dict(lr=lr, eta=eta, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = p.grad.add(p, alpha=group["weight_decay"])
                w, u = torch.linalg.vector_norm(p), torch.linalg.vector_norm(update)
                trust = torch.where((w > 0) & (u > 0), group["eta"] * w / u, torch.ones_like(w))
                p.add_(update * trust, alpha=-group["lr"])


@pytest.mark.parametrize("wrap", ["zero3", "fsdp_hybrid"])
def test_an_optimizer_with_per_tensor_norms_steps_pieces_like_one_process(wrap):
    def run(model, rank, world):
        return train(model, lambda m: 0.0, rank, world, LARS)[1]

    want = run(built(), 0, 1)
    for state in sw.launch(lambda comm: run(WRAPS[wrap](built(), comm), comm.rank, comm.size), 4):
        assert_state_close(state, want)
