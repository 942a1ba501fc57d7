"""One device per Communicator: every tensor shardwise hands to a collective is on `comm.device`, and strategies put
the model there at wrap time.

No GPU is needed. `Probe` delegates to a real thread communicator but declares its own `device`; switched to the
meta device after wrapping, it checks the first collective a test arms it for: the tensor must be on `comm.device`
(meta), never where the old code put it (CPU, or the gradients' device). It then stops the caller with `Reached`
before anything would need the tensor's values (a meta tensor has none). Under NCCL the same code puts those tensors
on the rank's GPU, where a CPU tensor fails.
"""

from __future__ import annotations

import pytest
import torch
from parity import batch, frozen_model
from torch import nn

import shardwise as sw
from shardwise.agreement import agree_on_recovery, check_agreement
from shardwise.checkpoint.barrier import io_barrier
from shardwise.comm.base import ReduceOp
from shardwise.comm.objects import all_gather_json, broadcast_json
from shardwise.comm.thread_backend import ThreadWorld

META = torch.device("meta")


class Reached(Exception):
    """The armed collective was reached with its tensors on the declared device."""


class Probe:
    """A communicator that delegates to `inner`, declares `device`, and checks the collectives it is armed for."""

    def __init__(self, inner, device: torch.device | str = "cpu") -> None:
        self.inner = inner
        self.device = torch.device(device)
        self.armed = None  # a predicate on the collective's tensors; None: delegate everything
        self.seen: list[tuple[str, list[torch.device]]] = []

    def __getattr__(self, name):  # rank, size, backend, global_ranks, timeout, stats, ...
        return getattr(self.inner, name)

    def arm(self, device=META, select=lambda t: True) -> Probe:
        self.device = torch.device(device)
        self.armed = select
        return self

    def _probe(self, op: str, *tensors: torch.Tensor) -> None:
        if self.armed is None or not any(self.armed(t) for t in tensors):
            return
        self.seen.append((op, [t.device for t in tensors]))
        wrong = [str(t.device) for t in tensors if t.device != self.device]
        assert not wrong, f"{op} was handed tensors on {wrong}, but comm.device is {self.device}"
        raise Reached(op)

    def all_reduce(self, tensor, op=ReduceOp.SUM, *, async_op=False):
        self._probe("all_reduce", tensor)
        return self.inner.all_reduce(tensor, op, async_op=async_op)

    def all_gather(self, output, input, *, async_op=False):
        self._probe("all_gather", output, input)
        return self.inner.all_gather(output, input, async_op=async_op)

    def reduce_scatter(self, output, input, op=ReduceOp.SUM, *, async_op=False, scratch_input=False):
        self._probe("reduce_scatter", output, input)
        return self.inner.reduce_scatter(output, input, op, async_op=async_op, scratch_input=scratch_input)

    def broadcast(self, tensor, src=0, *, async_op=False):
        self._probe("broadcast", tensor)
        return self.inner.broadcast(tensor, src, async_op=async_op)

    def split(self, color, key=None):
        sub = self.inner.split(color, key)
        return None if sub is None else Probe(sub, self.device)


def _one() -> Probe:
    return Probe(ThreadWorld(1).communicators()[0])


def _on_two_ranks(body):
    """Run body(probe) on two thread ranks; every rank must reach its armed collective on comm.device."""
    def rank(comm):
        probe = Probe(comm)
        with pytest.raises(Reached):
            body(probe)
        return [(op, [str(d) for d in devices]) for op, devices in probe.seen]
    return sw.launch(rank, 2)


# ---- strategies move the model to comm.device -------------------------------------------------------------------
@pytest.mark.parametrize("wrap", [
    lambda m, c: sw.DDP(m, c),
    lambda m, c: sw.ZeRO(m, c, stage=3),
    lambda m, c: sw.FSDP(m, c, sharding="shard_grad_op"),
    lambda m, c: sw.tensor_parallel.parallelize(m, c, "gpt"),
], ids=["ddp", "zero3", "shard_grad_op", "tensor_parallel"])
def test_wrapping_moves_a_cpu_model_to_comm_device(wrap):
    model = frozen_model()
    wrapped = wrap(model, _one().arm(META, select=lambda t: False))  # nothing to stop: only the device is declared
    devices = {p.device for p in wrapped.parameters()} | {b.device for b in wrapped.buffers()}
    assert devices == {META}


def test_parallelize_moves_the_model_to_the_mesh_device():
    probe = _one().arm(META, select=lambda t: False)
    model = sw.parallelize(frozen_model(), sw.Mesh(probe, dp=1, tp=1, pp=1))
    assert {p.device for p in model.parameters()} == {META}


@pytest.mark.parametrize("model_device, match", [
    ("meta", r"DDP: the model has parameters or buffers on the meta device .* materialise them on cpu"),
])
def test_a_model_that_cannot_be_moved_is_a_clear_error(model_device, match):
    model = nn.Linear(4, 4, device=model_device)
    with pytest.raises(ValueError, match=match):
        sw.DDP(model, _one())


def test_a_model_on_another_gpu_is_refused_naming_both():
    """Rank 1's NCCL communicator runs on cuda:1; a model the user put on cuda:0 is an error, not a silent copy."""
    from types import SimpleNamespace

    from shardwise.placement import to_comm_device

    class OnCuda0:  # what to_comm_device reads of a module: its parameters' and buffers' devices
        def parameters(self):
            return [SimpleNamespace(device=torch.device("cuda", 0))]

        def buffers(self):
            return []

    comm = SimpleNamespace(device=torch.device("cuda", 1), backend="nccl")
    with pytest.raises(ValueError, match=r"DDP: the model has tensors on \['cuda:0'\] but its communicator \(nccl\) "
                                         r"runs on cuda:1; move the model to cuda:1 before wrapping"):
        to_comm_device(OnCuda0(), comm, "DDP")


# ---- tensors the library allocates for collectives --------------------------------------------------------------
def test_ddp_unused_parameter_flags_are_on_comm_device():
    def body(probe):
        model = sw.DDP(frozen_model(), probe, find_unused_parameters=True)
        probe.arm(META, select=lambda t: t.dtype == torch.int32)  # the used-flags, not the gradient buckets
        x, y = batch(0, probe.rank, probe.size)
        model(x, y).backward()
    assert all(seen == [("all_reduce", ["meta"])] for seen in _on_two_ranks(body))


def test_grad_scaler_found_inf_flag_is_on_comm_device():
    model = nn.Linear(4, 4)
    model(torch.randn(2, 4)).sum().backward()
    probe = _one().arm(META)
    scaler = sw.ShardedGradScaler(probe)
    with pytest.raises(Reached):
        scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.1))
    assert probe.seen == [("all_reduce", [META])]


def _offloaded_zero3(probe):
    model = sw.ZeRO(frozen_model(), probe, stage=3, cpu_offload=True)
    x, y = batch(0, probe.rank, probe.size)
    model(x, y).backward()
    assert all(p.grad is None or p.grad.device.type == "cpu" for p in model.parameters())  # offloaded: on CPU
    return model


def test_clip_grad_norm_under_cpu_offload_reduces_on_comm_device():
    def body(probe):
        model = _offloaded_zero3(probe)
        probe.arm(META)
        sw.clip_grad_norm_(model, 1.0)
    assert all(seen == [("all_reduce", ["meta"])] for seen in _on_two_ranks(body))


def test_full_state_dict_under_cpu_offload_gathers_on_comm_device():
    def body(probe):
        model = _offloaded_zero3(probe)
        probe.arm(META)
        sw.full_state_dict(model)
    assert all(seen == [("all_gather", ["meta", "meta"])] for seen in _on_two_ranks(body))


@pytest.mark.parametrize("call, op", [
    (lambda c: check_agreement(c, "test", {"x": 1}), "all_gather"),
    (lambda c: agree_on_recovery(c, "test"), "all_reduce"),
    (lambda c: all_gather_json(c, {"rank": c.rank}), "all_gather"),
    (lambda c: broadcast_json(c, {"x": 1}), "all_reduce"),
    (lambda c: io_barrier(c, 5.0), "all_reduce"),
], ids=["agreement", "recovery", "all_gather_json", "broadcast_json", "checkpoint_io_barrier"])
def test_control_tensors_are_on_comm_device(call, op):
    def body(probe):
        probe.arm(META)
        call(probe)
    for seen in _on_two_ranks(body):
        assert seen[0][0] == op and set(seen[0][1]) == {"meta"}
