"""Ranks whose forwards run different layers of one size under ZeRO-3 / FSDP raise, naming both units.

LayerDrop drawn from each rank's own generator, or a branch on the rank's own data, makes the ranks skip different
layers. When the layers have one size, the gathers of layer 1 on one rank and layer 2 on the other were the same call
to every ordering check (kind and element count), so they paired: each rank computed with a layer of mixed halves and
both reported a loss neither one process computes (0.0489 where one process gives 0.0750 and 0.0537), with no error.
The sharding engine now names each unit's collectives (comm/labels.py) and the checks compare the names."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.comm.labels import collective_label, labelled


class SkipsOneLayer(nn.Module):
    """Four equal layers; the forward skips layer `skip` (set per rank)."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
        self.skip: int | None = None

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            if i != self.skip:
                x = torch.tanh(layer(x))
        return x.pow(2).mean()


def _diverging(comm, strategy):
    model = SkipsOneLayer()
    model.skip = 1 + comm.rank  # rank 0 skips layer 1, rank 1 skips layer 2
    wrapped = sw.ZeRO(model, comm, stage=3, wrap=nn.Linear) if strategy == "zero3" else \
        sw.FSDP(model, comm, wrap=nn.Linear)
    wrapped(torch.ones(2, 8)).backward()


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_thread_ranks_that_run_different_equal_layers_raise_naming_both(strategy):
    with pytest.raises(sw.LaunchError, match=r"all_gather\(numel=36, dtype=torch.float32, for=unit layers.[12]\)"):
        sw.launch(_diverging, 2, strategy)


@pytest.mark.multiprocess
def test_gloo_processes_that_run_different_equal_layers_raise_naming_both():
    with pytest.raises(sw.LaunchError) as raised:
        sw.launch(_diverging, 2, "zero3", backend="gloo")
    text = str(raised.value)
    assert "all_gather(numel=36, for=unit layers.2)" in text and "all_gather(numel=36, for=unit layers.1)" in text, text


def _diverging_unchecked(comm, strategy):
    """As on NCCL, where no call is checked: a group split off with SHARDWISE_CHECK_COLLECTIVES=0 and no shared
    memory (whose channel checks in band). Under hybrid_shard the gathers run on the shard groups of 2, which the
    check compares besides the data-parallel world."""
    import os

    os.environ["SHARDWISE_CHECK_COLLECTIVES"], os.environ["SHARDWISE_SHM"] = "0", "0"
    group = comm.split(0)
    model = SkipsOneLayer()
    model.skip = 1 + comm.rank % 2
    wrapped = sw.ZeRO(model, group, stage=3, wrap=nn.Linear) if strategy == "zero3" else \
        sw.FSDP(model, group, sharding="hybrid_shard", shard_size=2, wrap=nn.Linear)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3, weight_decay=0.1)
    wrapped(torch.ones(2, 8)).backward()  # pairs layer 1's gathers with layer 2's: no error here
    before = [p.detach().clone() for p in wrapped.parameters()]
    try:
        opt.step()
    except ValueError as exc:
        unchanged = all(torch.equal(a, p) for a, p in zip(before, wrapped.parameters()))
        return str(exc), unchanged
    return None, False


@pytest.mark.multiprocess
@pytest.mark.parametrize(("strategy", "ranks", "backend"), [("zero3", 2, "gloo"), ("fsdp:hybrid_shard", 4, "gloo"),
                                                           ("zero3", 2, "mpi")])
def test_unchecked_groups_compare_the_collectives_issued_before_the_first_step(strategy, ranks, backend):
    """Where no call is checked (NCCL; gloo or MPI with SHARDWISE_CHECK_COLLECTIVES=0), the optimizer guard compares
    a running hash of each rank's collectives at the first step and every 20th: the divergent forward raises at the
    first step, which changes nothing."""
    for message, unchanged in sw.launch(_diverging_unchecked, ranks, strategy, backend=backend, timeout=60):
        assert message is not None and "the ranks of its group disagree: collectives issued on this group" in message
        assert "run the same modules, in the same order, on every rank" in message
        assert unchanged


def _same_layers(comm):
    model = SkipsOneLayer()
    model.skip = 1  # every rank skips the same layer: no error, one process's loss
    wrapped = sw.ZeRO(model, comm, stage=3, wrap=nn.Linear)
    loss = wrapped(torch.ones(2, 8))
    loss.backward()
    return float(loss.detach())


def test_ranks_that_skip_the_same_layer_train_as_one_process():
    reference = SkipsOneLayer()
    reference.skip = 1
    want = float(reference(torch.ones(2, 8)).detach())
    assert sw.launch(_same_layers, 2) == [want, want]


def test_a_label_names_the_collectives_issued_inside_it_only():
    assert labelled("all_gather(numel=8)") == "all_gather(numel=8)"
    with collective_label("unit blocks.3"):
        assert labelled("all_gather(numel=8)") == "all_gather(numel=8, for=unit blocks.3)"
        with collective_label("unit blocks.3.mlp"):
            want = "reduce_scatter(op=AVG, numel=4, for=unit blocks.3.mlp)"
            assert labelled("reduce_scatter(op=AVG, numel=4)") == want
        assert labelled("all_gather(numel=8)") == "all_gather(numel=8, for=unit blocks.3)"
    assert labelled("all_gather(numel=8)") == "all_gather(numel=8)"
