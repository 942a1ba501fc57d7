"""GPU tests (`make test-gpu`, marker `gpu`): the CUDA paths on a real device, NCCL in a world of one process.

Skipped, with the reason printed (pytest -ra), where CUDA is absent; nothing here is the only proof of anything:
device placement, stream ordering and timeouts are checked on CPU by tests/test_device_placement.py and
tests/test_streams.py. References are computed: the same model and batches trained by plain PyTorch on the same GPU.
"""

from __future__ import annotations

import datetime

import pytest
import torch
from parity import CONFIG, batch

import shardwise as sw
from shardwise.models import GPT
from shardwise.models.gpt import Block

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: the GPU tests need one "
                                                              "(make test-gpu on a GPU machine)"),
]


@pytest.fixture
def nccl_world_of_one():
    """A one-rank NCCL default group in this process (destroyed afterwards) and its Communicator."""
    import torch.distributed as dist

    from shardwise.comm.torch_backend import TorchCommunicator

    if not dist.is_nccl_available():
        pytest.skip("this PyTorch build has no NCCL")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=600))
    try:
        yield TorchCommunicator(None, timeout=60.0)
    finally:
        dist.destroy_process_group()


def _train(model, steps=4, device="cuda"):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        x, y = (t.to(device) for t in batch(step))
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def _reference(steps=4):
    return _train(GPT(CONFIG, seed=0).cuda(), steps)


def test_nccl_communicator_is_on_the_gpu_and_streams_are_enabled(nccl_world_of_one):
    comm = nccl_world_of_one
    assert comm.device == torch.device("cuda", 0)
    t = torch.ones(8, device=comm.device)
    work = comm.all_reduce(t, async_op=True)
    work.wait()  # a stream wait
    torch.cuda.synchronize()
    assert t.tolist() == [1.0] * 8


def test_ddp_moves_a_cpu_model_and_matches_plain_pytorch(nccl_world_of_one):
    model = sw.DDP(GPT(CONFIG, seed=0), nccl_world_of_one)  # the README quickstart: built on CPU
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    got, want = _train(model), _reference()
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)


def test_zero3_matches_plain_pytorch_and_bf16_tracks_it(nccl_world_of_one):
    fp32 = _train(sw.ZeRO(GPT(CONFIG, seed=0), nccl_world_of_one, stage=3, wrap=Block))
    want = _reference()
    torch.testing.assert_close(torch.tensor(fp32), torch.tensor(want), rtol=1e-5, atol=1e-6)
    mp = sw.MixedPrecision(param_dtype=torch.bfloat16)
    bf16 = _train(sw.ZeRO(GPT(CONFIG, seed=0), nccl_world_of_one, stage=3, wrap=Block, mixed_precision=mp))
    for a, b in zip(want, bf16):
        assert abs(a - b) <= 0.02 * a, (want, bf16)  # bf16 keeps ~3 significant digits (as the CPU test states)


def test_zero3_cpu_offload_clips_and_gathers_through_the_gpu(nccl_world_of_one):
    model = sw.ZeRO(GPT(CONFIG, seed=0), nccl_world_of_one, stage=3, wrap=Block, cpu_offload=True)
    x, y = (t.cuda() for t in batch(0))
    model(x, y).backward()
    norm = sw.clip_grad_norm_(model, 1.0)
    assert torch.isfinite(torch.as_tensor(float(norm)))
    state = sw.full_state_dict(model)
    assert set(state) == set(GPT(CONFIG, seed=0).state_dict())
