"""GPU tests (`make test-gpu`, marker `gpu`): the CUDA paths on a real device, NCCL in a world of one process.

Skipped, with the reason printed (pytest -ra), where CUDA is absent; nothing here is the only proof of anything:
device placement, stream ordering and timeouts are checked on CPU by tests/test_device_placement.py and
tests/test_streams.py. References are computed: the same model and batches trained by plain PyTorch on the same GPU.

Two kinds of worlds: NCCL with one process (the `nccl_world_of_one` fixture: the real backend, its streams and
waits, one rank), and thread ranks whose tensors live on cuda:0 (`ThreadWorld(n, device="cuda:0")`, strict mode as
everywhere in the suite: NCCL's ordering rules, and every tensor handed to a collective must be on comm.device) for
the multi-rank logic of tensor and pipeline parallelism on a single GPU. The throughput counterpart is bench/gpu.py.
"""

from __future__ import annotations

import dataclasses
import datetime

import pytest
import torch
from parity import CONFIG, batch

import shardwise as sw
from shardwise.activation_checkpointing import checkpoint_module
from shardwise.sharded_tensor import local
from shardwise import pipeline as pp
from shardwise import tensor_parallel as tp
from shardwise.comm.thread_backend import ThreadWorld
from shardwise.models import GPT
from shardwise.models.gpt import Block, lm_loss

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: the GPU tests need one "
                                                              "(make test-gpu on a GPU machine)"),
]


@pytest.fixture(params=["nccl", "local"])
def nccl_world_of_one(request):
    """A one-rank NCCL default group in this process (destroyed afterwards) and its Communicator: "nccl" issues
    every collective through NCCL and its side streams (`local_if_alone=False`), "local" as a user's world of one
    (the collectives of a group of one done locally, comm/group_of_one.py)."""
    import torch.distributed as dist

    from shardwise.comm.torch_backend import TorchCommunicator

    if not dist.is_nccl_available():
        pytest.skip("this PyTorch build has no NCCL")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=600))
    try:
        yield TorchCommunicator(None, timeout=60.0, local_if_alone=request.param == "local")
    finally:
        if dist.is_initialized():  # a failed collective may have taken the group down already
            dist.destroy_process_group()


@pytest.fixture
def cuda0():
    """cuda:0 as the current device (thread ranks set it again: it is per thread), for the thread-rank tests."""
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def _train(model, steps=4, device="cuda", weight_decay=0.01):  # AdamW's default decay
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=weight_decay)
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


def _thread_ranks_on_cuda(n, body, *args):
    """body(comm, *args) on `n` thread ranks of a ThreadWorld whose comm.device is cuda:0; results in rank order.
    A rank that raises aborts the world (the others' next wait raises) and the first error is re-raised here."""
    import threading

    world = ThreadWorld(n, timeout=60, device="cuda:0")
    comms = world.communicators()
    assert all(c.device == torch.device("cuda", 0) for c in comms)
    out, errors = [None] * n, {}

    def main(rank):
        torch.cuda.set_device(0)  # a new thread starts on the current device of none in particular
        torch.autograd.set_multithreading_enabled(False)  # each rank's backward on its own thread (launch says why)
        try:
            out[rank] = body(comms[rank], *args)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, named by rank
            errors[rank] = exc
            world.abort(f"rank {rank} raised {exc!r}", rank)

    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a thread rank hung"
    if errors:
        rank = min(errors)
        raise AssertionError(f"rank {rank} raised {errors[rank]!r}") from errors[rank]
    return out


def _close_to(got, want, rel):
    for a, b in zip(want, got):
        assert abs(a - b) <= rel * a, (want, got)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_in_bf16_track_fp32_plain_pytorch(nccl_world_of_one, stage):
    mp = sw.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = sw.ZeRO(GPT(CONFIG, seed=0), nccl_world_of_one, stage=stage, wrap=Block, mixed_precision=mp)
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    _close_to(_train(model), _reference(), 0.02)  # bf16 keeps ~3 significant digits


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_in_fp16_with_the_sharded_scaler_track_fp32_and_skip_an_overflow(nccl_world_of_one, stage):
    comm = nccl_world_of_one
    mp = sw.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32)
    model = sw.ZeRO(GPT(CONFIG, seed=0), comm, stage=stage, wrap=Block, mixed_precision=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = sw.ShardedGradScaler(comm, init_scale=1024.0)
    losses, taken = [], []
    for step in range(5):
        x, y = (t.cuda() for t in batch(step))
        loss = model(x, y)
        scaler.scale(loss).backward()
        if step == 2:  # an overflow: the found-inf flag (a CUDA tensor on NCCL) must skip the step and halve the scale
            next(local(p.grad) for p in model.parameters() if p.grad is not None and local(p.grad).numel()).view(
                -1)[0] = float("inf")
        before = scaler.get_scale()
        taken.append(scaler.step(opt))
        scaler.update()
        if step == 2:
            assert scaler.get_scale() == before / 2
        opt.zero_grad()
        if step != 2:
            losses.append(float(loss))
    assert taken == [True, True, False, True, True]
    assert all(torch.isfinite(p).all() for p in model.parameters())  # the skipped step left no inf behind
    _close_to(losses[:2], _reference(2), 0.02)  # fp16 compute with fp32 masters: ~3 digits, as bf16


def test_tensor_parallel_on_thread_ranks_with_cuda_tensors_matches_one_gpu(cuda0):
    eps = 1e-5  # tests/test_tensor_parallel_gpt.py explains why tensor parallel parity uses eps 1e-5

    def train(model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=eps)
        for step in range(3):
            x, y = (t.cuda() for t in batch(step))
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        return model

    want = {k: v.detach().clone() for k, v in train(GPT(CONFIG, seed=0).cuda()).state_dict().items()}

    def body(comm, base):
        model = tp.parallelize(base.cuda(), comm, "gpt", sequence_parallel=True)
        assert {p.device.type for p in model.parameters()} == {"cuda"}
        return tp.full_state_dict(train(model))

    bases = [GPT(CONFIG, seed=0) for _ in range(2)]  # built here: thread ranks share torch's default RNG
    for got in _thread_ranks_on_cuda(2, lambda comm: body(comm, bases[comm.rank])):
        assert list(got) == list(want)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_tensor_parallel_dropout_keeps_replicas_equal_and_checkpointing_replays_it_on_cuda(cuda0):
    """The dropout stream on CUDA (tests/test_tp_dropout.py on CPU): generators on the device, the fingerprint's
    host sync, attention dropout in the math form."""
    config = dataclasses.replace(CONFIG, dropout=0.1)
    bases = [[GPT(config, seed=0) for _ in range(2)] for _ in range(2)]  # built here: thread ranks share the RNG

    def body(comm):
        plain = tp.parallelize(bases[0][comm.rank].cuda(), comm, "gpt")
        checkpointed = tp.parallelize(bases[1][comm.rank].cuda(), comm, "gpt")
        for block in checkpointed.blocks:
            checkpoint_module(block)
        x, y = (t.cuda() for t in batch(0))
        grads = []
        for model in (plain, checkpointed):
            model(x, y).backward()
            grads.append({n: local(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None})
        opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.1)
        opt.step()
        return grads, tp.full_state_dict(plain)

    ranks = _thread_ranks_on_cuda(2, body)
    for (want, got), _ in ranks:
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    first, second = ranks[0][1], ranks[1][1]
    for name in first:
        assert torch.equal(first[name], second[name]), f"{name} differs between the tp ranks"


def test_inductor_compiles_a_tensor_parallel_model_with_dropout_and_it_trains_as_the_eager_one(cuda0):
    """torch.compile's default backend on a split model with dropout (tests/test_compile.py on CPU): the dropout
    stream's draws run eagerly between the compiled graphs, so both runs draw the same masks."""
    import copy

    bases = [GPT(dataclasses.replace(CONFIG, dropout=0.1), seed=0) for _ in range(2)]  # thread ranks share the RNG

    def body(comm, compiled):
        model = tp.parallelize(copy.deepcopy(bases[comm.rank]).cuda(), comm, "gpt")
        return _train(torch.compile(model) if compiled else model, steps=3, weight_decay=0.1)

    eager = _thread_ranks_on_cuda(2, body, False)
    compiled = _thread_ranks_on_cuda(2, body, True)
    assert eager[0] == eager[1] and compiled[0] == compiled[1]
    # inductor fuses elementwise ops (another rounding order); a mask not the eager one moves the loss by ~1e-2
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_a_pipeline_on_thread_ranks_with_cuda_tensors_matches_one_gpu(cuda0, schedule):
    config = CONFIG.__class__(**{**CONFIG.__dict__, "n_layers": 4})
    ref = GPT(config, seed=0).cuda()
    # eps 1e-5: microbatches run other cuBLAS kernels than the whole batch, and with eps 1e-8 Adam turns that rounding
    # on a near-zero gradient into an lr-sized step (one element of 16384 off by 2.7e-5 on an H100 at eps 1e-8)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-5)
    want_losses = []
    for step in range(3):
        x, y = (t.cuda() for t in batch(step))
        loss = ref(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want_losses.append(loss.item())
    want = {n: p.detach() for n, p in ref.named_parameters(remove_duplicate=False)}

    def body(comm, base):
        pipe = pp.Pipeline(pp.partition(base.cuda().pipeline_layers(), comm.size), comm, schedule=schedule,
                           n_microbatches=4, loss_fn=lm_loss)
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3, eps=1e-5)
        losses = []
        for step in range(3):
            x, y = (t.cuda() for t in batch(step))
            losses.append(float(pipe.step(x, y)))
            opt.step()
            opt.zero_grad()
        held = {id(p) for p in pipe.parameters()}
        return losses, {n: p.detach() for n, p in base.named_parameters(remove_duplicate=False) if id(p) in held}

    bases = [GPT(config, seed=0) for _ in range(2)]
    results = _thread_ranks_on_cuda(2, lambda comm: body(comm, bases[comm.rank]))
    got = {}
    for _, state in results:
        got.update(state)
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    last_stage_losses = results[-1][0]
    torch.testing.assert_close(torch.tensor(last_stage_losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-6)


def test_a_zero3_checkpoint_saved_on_the_gpu_resumes_exactly_and_loads_into_a_plain_model(nccl_world_of_one,
                                                                                          tmp_path):
    comm = nccl_world_of_one

    def fresh():
        model = sw.ZeRO(GPT(CONFIG, seed=0), comm, stage=3, wrap=Block)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def one_step(model, opt, step):
        x, y = (t.cuda() for t in batch(step))
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss)

    model, opt = fresh()
    for step in range(2):
        one_step(model, opt, step)
    sw.save_checkpoint(tmp_path / "ckpt", model, opt, step=2)
    continued = [one_step(model, opt, step) for step in (2, 3)]
    resumed_model, resumed_opt = fresh()
    assert sw.load_checkpoint(tmp_path / "ckpt", resumed_model, resumed_opt)["step"] == 2
    assert [one_step(resumed_model, resumed_opt, step) for step in (2, 3)] == continued  # same GPU, same kernels
    plain = GPT(CONFIG, seed=1)  # another init, on the CPU: the checkpoint's values must replace it
    sw.load_checkpoint(tmp_path / "ckpt", plain, comm=sw.comm.ThreadWorld(1).communicators()[0])
    reference, _ = fresh()
    sw.load_checkpoint(tmp_path / "ckpt", reference)
    want = sw.full_state_dict(reference)
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(value, want[name].cpu(), rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_torch_compile_of_a_unit_wrapped_zero3_model_matches_eager(nccl_world_of_one):
    eager = _train(sw.ZeRO(GPT(CONFIG, seed=0), nccl_world_of_one, stage=3, wrap=Block))
    model = sw.ZeRO(GPT(CONFIG, seed=0), nccl_world_of_one, stage=3, wrap=Block)
    got = _train(torch.compile(model))  # the units' hooks gather and free around each Block: graph breaks
    # Inductor fuses elementwise ops (another rounding order), so not bit-equal; a wrong gather or a stale shard
    # would be off by far more than this after 4 AdamW steps.
    torch.testing.assert_close(torch.tensor(got), torch.tensor(eager), rtol=1e-4, atol=1e-5)


def test_a_zero3_forward_and_backward_never_block_the_host(nccl_world_of_one):
    """The CPU runs ahead of the GPU through a whole forward and backward (gathers, reduce-scatters, used flags):
    torch's sync debug mode raises on any operation that would make the host wait for the device. (A used flag read
    back per unit did that once, halving ZeRO-3's tokens/s on an H100.)"""
    model = sw.ZeRO(GPT(CONFIG, seed=0), nccl_world_of_one, stage=3, wrap=Block)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = (t.cuda() for t in batch(0))
    model(x, y).backward()  # the first step records the order units run in
    opt.step()
    opt.zero_grad()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(x, y).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    opt.step()
