"""Agreement at wrap time: ranks that must hold the same model (a data-parallel group, a tensor-parallel group) or
the same schedule (a pipeline) check it with one small collective, and a difference raises naming what differs and
the ranks; replicated strategies start every replica from rank 0's values; bad arguments are named."""

from __future__ import annotations

import pytest
import torch
from parity import CONFIG
from torch import nn

import shardwise as sw
from shardwise import pipeline as pp
from shardwise import tensor_parallel as tp
from shardwise.models import GPT
from shardwise.models.gpt import lm_loss


def swapped(rank):
    torch.manual_seed(0)
    layers = [nn.Linear(8, 4), nn.Linear(4, 8)]
    return nn.Sequential(*(layers if rank == 0 else layers[::-1]))  # same element count, other order


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero3", "fsdp"])
def test_replicas_of_different_models_are_refused(strategy):
    def body(comm):
        model = swapped(comm.rank)
        with pytest.raises(ValueError, match=r"parameters\[0\]\[1\]\[0\] is 4 on rank 0 but 8 on rank 1"):
            if strategy == "ddp":
                sw.DDP(model, comm)
            elif strategy == "fsdp":
                sw.FSDP(model, comm)
            else:
                sw.ZeRO(model, comm, stage=int(strategy[-1]))

    sw.launch(body, 2)


def test_tensor_parallel_ranks_with_different_weights_are_refused():
    def body(comm):
        model = GPT(CONFIG, seed=comm.rank)  # same shapes, other values
        with pytest.raises(ValueError, match=r"parallelize: .*fingerprints\[0\] is .* on rank 0 but .* on rank 1"):
            tp.parallelize(model, comm, "gpt")

    sw.launch(body, 2)


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "no_shard", "hybrid_shard"])
def test_replicated_strategies_start_from_rank_zero(strategy):
    def body(comm):
        model = GPT(CONFIG, seed=comm.rank)  # every rank built differently seeded weights
        if strategy.startswith("zero"):
            model = sw.ZeRO(model, comm, stage=int(strategy[-1]))
        else:
            model = sw.FSDP(model, comm, sharding=strategy, shard_size=2 if strategy == "hybrid_shard" else None)
        return sw.full_state_dict(model)

    want = GPT(CONFIG, seed=0).state_dict()
    for state in sw.launch(body, 4):
        for name, value in want.items():
            assert torch.equal(state[name], value), name


def test_different_options_are_refused():
    def body(comm):
        with pytest.raises(ValueError, match=r"options.bucket_mb is 25 on rank 0 but 5 on rank 1"):
            sw.DDP(GPT(CONFIG, seed=0), comm, bucket_mb=25 if comm.rank == 0 else 5)

    sw.launch(body, 2)


def test_pipeline_ranks_that_disagree_on_the_schedule_are_refused():
    def body(comm):
        stages = pp.partition(GPT(CONFIG, seed=0).pipeline_layers(), 2)
        with pytest.raises(ValueError, match=r"Pipeline: .*n_microbatches is 4 on rank 0 but 8 on rank 1"):
            pp.Pipeline(stages, comm, "1f1b", 4 if comm.rank == 0 else 8, lm_loss)

    sw.launch(body, 2)


def test_bad_arguments_are_named():
    def body(comm):
        model = GPT(CONFIG, seed=0)
        with pytest.raises(ValueError, match="DDP: comm must be a shardwise Communicator .* got NoneType"):
            sw.DDP(model, None)
        with pytest.raises(ValueError, match="find_unused_parameters='yes' must be True or False"):
            sw.DDP(model, comm, find_unused_parameters="yes")
        with pytest.raises(ValueError, match="ZeRO: stage=True is not supported; allowed 1, 2 or 3"):
            sw.ZeRO(model, comm, stage=True)
        with pytest.raises(ValueError, match="prefetch='no' must be True or False"):
            sw.ZeRO(model, comm, stage=3, prefetch="no")

    sw.launch(body, 2)
