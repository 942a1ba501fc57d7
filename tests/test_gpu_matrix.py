"""The parity matrix on one GPU (marker `gpu`, run by `make gpu-check`): thread ranks whose tensors all live on
cuda:0 train the tiny GPT under every strategy that fits one device and must match one process on the same GPU.

Each cell is `sw.check(..., device="cuda:0")` (3 AdamW steps with weight decay and a binding clip: per step the loss,
every dense gradient, the clip norm and every parameter against one process on the global batch), or, where the
strategy's loop is not check's (pipelines and 3-D step inside a schedule; local SGD synchronises in `model.step()`),
the same comparison written out. CUDA kernels sum in other orders than CPU ones, so the tolerance is the suite's
(rtol 1e-5) with an absolute floor of 1e-5 where tensor parallel splits the matmuls.
On CPU the same cells run in tests/test_matrix_*.py and tests/test_hybrid.py; here only the device changes.
Expert parallel (a mixture-of-experts GPT, its tokens exchanged by all_to_all between CUDA thread ranks) runs the same
check; its cells are defined so that tests/test_experts_zero.py's CPU cases and these agree.
"""

from __future__ import annotations

import expert_cases
import pytest
import torch
from parity import CONFIG, RTOL, batch

import shardwise as sw
from shardwise.async_sgd import LocalSGD
from shardwise.experts import expert_parallel
from shardwise.models import GPT

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: the GPU matrix needs one "
                                                              "(make gpu-check on a GPU machine)"),
]

DEVICE = "cuda:0"


def build() -> GPT:
    return GPT(CONFIG, seed=0)


def global_batch(step: int):
    return batch(step)


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-5)


CELLS = {
    "ddp": ("ddp", 2),
    "zero1": ("zero1", 2),
    "zero2": ("zero2", 2),
    "zero3": ("zero3", 2),
    "fsdp": ("fsdp", 2),
    "fsdp_shard_grad_op": ("fsdp:shard_grad_op", 2),
    "fsdp_hybrid_shard": ("fsdp:hybrid_shard", 4),
    "tp": ("tp:gpt", 2),
    "tp2_zero3": ({"tp": 2, "tp_plan": "gpt", "dp_strategy": "zero3"}, 4),
    "tp2_sp_zero2": ({"tp": 2, "tp_plan": "gpt", "dp_strategy": "zero2", "sequence_parallel": True}, 4),
    "distribute": ("distribute", 2),
    "ddp_bf16_compression": (lambda model, comm: sw.DDP(model, comm, compression=sw.compression.BF16()), 2),
}


@pytest.mark.parametrize("cell", list(CELLS))
def test_a_strategy_on_cuda_thread_ranks_matches_one_gpu(cell):
    strategy, world = CELLS[cell]
    lossy = cell.endswith("compression")
    report = sw.check(build, global_batch, strategy=strategy, world_size=world, optimizer=optimizer, max_norm=0.3,
                      device=DEVICE, rtol=2e-2 if lossy else RTOL, atol=1e-3 if lossy else 1e-5)
    assert report.ok, report.text(verbose=True)


def _dense(steps: int, max_norm: float | None = None, opt_fn=optimizer):
    model = build().to(DEVICE)
    opt = opt_fn(model.parameters())
    losses = []
    for step in range(steps):
        x, y = (t.to(DEVICE) for t in batch(step))
        loss = model(x, y)
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}, losses


def _close(got: dict, want: dict, atol: float = 1e-5) -> None:
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name].cpu(), want[name], rtol=RTOL, atol=atol, msg=lambda m: f"{name}: {m}")


def _three_d(comm, steps: int):
    mesh = sw.Mesh(comm, dp=2, tp=2, pp=2)
    model = sw.parallelize(build(), mesh, tp_plan="gpt", dp_strategy="zero3")
    opt = optimizer(model.parameters())
    for step in range(steps):
        x, y = (t.to(DEVICE) for t in batch(step, mesh.coords.dp, 2))
        model.step(x, y)
        sw.clip_grad_norm_(model, 0.3)
        opt.step()
        opt.zero_grad()
    return {k: v.cpu() for k, v in sw.full_state_dict(model).items()}


def test_three_d_dp2_tp2_pp2_on_cuda_thread_ranks_matches_one_gpu():
    want, _ = _dense(3, max_norm=0.3)
    for state in sw.launch(_three_d, 8, 3, device=DEVICE, timeout=120):
        _close(state, want)


def _local_sgd(comm, steps: int):
    model = LocalSGD(build(), comm, sync_every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = (t.to(DEVICE) for t in batch(step, comm.rank, comm.size))
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        model.step()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def test_local_sgd_synchronising_every_step_on_cuda_thread_ranks_equals_one_gpu():
    """Averaging parameters after every plain SGD step is averaging the gradients (the local SGD / DDP identity)."""
    want, _ = _dense(3, opt_fn=lambda p: torch.optim.SGD(p, lr=0.1))
    for state in sw.launch(_local_sgd, 2, 3, device=DEVICE):
        _close(state, want)


def _context_parallel(comm, method: str, steps: int):
    from shardwise import context_parallel as cp

    model = sw.DDP(cp.apply(build(), comm, method=method), comm)
    opt = optimizer(model.parameters())
    for step in range(steps):
        x, y = cp.split_sequence(batch(step), comm)
        model(x.to(DEVICE), y.to(DEVICE)).backward()
        sw.clip_grad_norm_(model, 0.3)
        opt.step()
        opt.zero_grad()
    return {k: v.cpu() for k, v in sw.full_state_dict(model).items()}


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_context_parallel_cp2_on_cuda_thread_ranks_matches_one_gpu(method):
    """Ring attention's K/V blocks go round the ring by point-to-point between CUDA thread ranks; Ulysses by
    all_to_all. Each rank's loss is the mean over its chunk's tokens (equal counts), DDP averages over cp."""
    want, _ = _dense(3, max_norm=0.3)
    for state in sw.launch(_context_parallel, 2, method, 3, device=DEVICE, timeout=120):
        _close(state, want)


EXPERT_CELLS = {
    "ep2_ddp": lambda model, comm: sw.DDP(expert_parallel(model, comm), comm),
    "ep2_zero3": lambda model, comm: sw.ZeRO(expert_parallel(model, comm), comm, stage=3),
}


def check_expert_cell(cell: str, device: str) -> sw.CheckReport:
    """A mixture-of-experts GPT (8 experts, top-2, balance loss) with its experts split over 2 ranks (ep = dp = 2),
    dense parameters averaged by DDP or sharded by ZeRO-3, against one process on `device`."""
    return sw.check(lambda: GPT(expert_cases.CFG, seed=0), expert_cases.batch, strategy=EXPERT_CELLS[cell],
                    world_size=2, optimizer=optimizer, max_norm=0.3, device=device, rtol=RTOL, atol=1e-5)


@pytest.mark.parametrize("cell", list(EXPERT_CELLS))
def test_expert_parallel_on_cuda_thread_ranks_matches_one_gpu(cell):
    report = check_expert_cell(cell, DEVICE)
    assert report.ok, report.text(verbose=True)
