"""partition(): balanced contiguous stages by parameters, by time or at explicit cuts; errors; shared modules."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from shardwise import pipeline as pp
from shardwise.models import GPT, GPTConfig

CONFIG = GPTConfig.preset("tiny", n_layers=6)


def _sizes(stages):
    return [(s.start, s.stop) for s in stages]


def _weight(stage):
    return sum(p.numel() for layer in stage for p in layer.parameters())


def test_gpt_layers_split_into_contiguous_stages_holding_the_models_own_modules():
    model = GPT(CONFIG, seed=0)
    layers = model.pipeline_layers()
    stages = pp.partition(layers, n_stages=4)
    assert [s.index for s in stages] == [0, 1, 2, 3]
    bounds = _sizes(stages)
    assert bounds[0][0] == 0 and bounds[-1][1] == len(layers)
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(bounds, bounds[1:]))
    assert stages[1][0] is layers[bounds[1][0]]  # the same module, not a copy
    idx = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_len))
    x = idx
    for stage in stages:
        x = stage(x)
    torch.testing.assert_close(x, model(idx), rtol=0, atol=0)


@pytest.mark.parametrize("n_stages", [2, 3, 4, 8])
def test_params_balance_minimises_the_heaviest_stage(n_stages):
    layers = GPT(CONFIG, seed=0).pipeline_layers()
    stages = pp.partition(layers, n_stages=n_stages, balance="params")
    weights = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    best = min(
        max(sum(weights[a:b]) for a, b in zip((0, *cuts), (*cuts, len(layers))))
        for cuts in itertools.combinations(range(1, len(layers)), n_stages - 1)
    )
    assert max(_weight(s) for s in stages) == best


def test_time_balance_uses_measured_forward_times():
    fast, slow = nn.Linear(64, 64), nn.Sequential(*[nn.Linear(64, 64) for _ in range(40)])
    layers = [fast, fast, fast, slow]  # the last layer is 40 Linears deep: it gets a stage of its own
    # A median of 9 runs: on a loaded 2-core machine a rank thread can stall one or two of the fast layer's runs.
    stages = pp.partition(layers, 2, balance="time", sample_input=torch.randn(256, 64), repeats=9)
    assert _sizes(stages) == [(0, 3), (3, 4)]
    with pytest.raises(ValueError, match="balance='time' needs sample_input"):
        pp.partition(layers, 2, balance="time")


def test_explicit_cuts_and_virtual_stages():
    layers = nn.Sequential(*[nn.Linear(4, 4) for _ in range(8)])
    assert _sizes(pp.partition(layers, 3, balance=[1, 5])) == [(0, 1), (1, 5), (5, 8)]
    stages = pp.partition(nn.ModuleList(layers), 2, virtual_stages=2)
    assert len(stages) == 4 and _sizes(stages) == [(0, 2), (2, 4), (4, 6), (6, 8)]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n_stages=9), r"9 x 1 = 9 stages but the model has only 8 layers"),
        (dict(n_stages=4, virtual_stages=3), r"4 x 3 = 12 stages but the model has only 8 layers"),
        (dict(n_stages=3, balance=[5, 1]), r"must be 2 strictly increasing cut points in 1..7"),
        (dict(n_stages=3, balance=[0, 4]), r"must be 2 strictly increasing cut points"),
        (dict(n_stages=2, balance=[3, 4]), r"must be 1 strictly increasing cut points"),
        (dict(n_stages=2, balance="flops"), r"balance='flops' is not allowed"),
        (dict(n_stages=0), r"n_stages=0 must be a positive int"),
    ],
)
def test_bad_partitions_are_value_errors(kwargs, match):
    layers = [nn.Linear(4, 4) for _ in range(8)]
    with pytest.raises(ValueError, match=match):
        pp.partition(layers, **kwargs)


def test_a_single_module_is_not_a_layer_list():
    with pytest.raises(ValueError, match="pass an nn.Sequential, an nn.ModuleList or a list"):
        pp.partition(GPT(CONFIG, seed=0), 2)
