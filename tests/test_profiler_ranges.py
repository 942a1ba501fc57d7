"""profiler_ranges.py: under torch.profiler every hook of the sharding engine and the DDP reducer, and every compute
action of a pipeline, shows as a named range, once per unit (bucket, action) per step; with no profiler running, no
record_function is entered at all."""

from __future__ import annotations

import collections

import torch
from torch.profiler import profile

import shardwise as sw
from shardwise.comm import ThreadWorld
from shardwise.models.gpt import GPT, Block, GPTConfig
from shardwise.profiler_ranges import profiler_range

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=2)


def _ranges_of_one_step(model: torch.nn.Module) -> collections.Counter:
    """The shardwise ranges (name -> count) of the second training step (the first records the forward order)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=torch.Generator().manual_seed(0))
    model(x, x).backward()
    opt.step()
    opt.zero_grad()
    with profile() as prof:
        model(x, x).backward()
    return collections.Counter({e.key: e.count for e in prof.key_averages() if e.key.startswith("shardwise::")})


def test_zero3_hooks_are_named_ranges_once_per_unit_per_step():
    comm = ThreadWorld(1).communicators()[0]
    ranges = _ranges_of_one_step(sw.ZeRO(GPT(CFG, seed=0), comm, stage=3, wrap=Block))
    units = ["blocks.0", "blocks.1"]
    expected = {"shardwise::root_pre_forward": 1, "shardwise::finish_backward": 1}
    for unit in units:
        expected[f"shardwise::pre_forward ({unit})"] = 1
    for unit in [*units, "<root>"]:
        for what in ("post_forward", "pre_backward", "reduce_scatter", "finish_reduce"):
            expected[f"shardwise::{what} ({unit})"] = 1
    assert ranges == expected


def test_ddp_buckets_and_end_of_backward_are_named_ranges():
    comm = ThreadWorld(1).communicators()[0]
    model = sw.DDP(GPT(CFG, seed=0), comm, bucket_mb=0.01, first_bucket_mb=0.01)
    buckets = len(model.ddp_buckets())
    assert buckets > 1
    ranges = _ranges_of_one_step(model)
    assert ranges == {"shardwise::ddp_finish_backward": 1,
                      **{f"shardwise::ddp_all_reduce (bucket {i})": 1 for i in range(buckets)}}


def test_pipeline_actions_are_named_ranges():
    """A world of one running two stages (interleaved 1F1B, two virtual stages): every compute action of the
    schedule is one range named as the schedule writes it."""
    from shardwise import pipeline as pp
    from shardwise.models import lm_loss

    comm = ThreadWorld(1).communicators()[0]
    model = GPT(CFG, seed=0)
    stages = pp.partition(model.pipeline_layers(), 1, virtual_stages=2)
    pipe = pp.Pipeline(stages, comm, schedule="interleaved_1f1b", n_microbatches=2, loss_fn=lm_loss)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=torch.Generator().manual_seed(0))
    pipe.step(x, x)
    with profile() as prof:
        pipe.step(x, x)
    ranges = collections.Counter({e.key: e.count for e in prof.key_averages() if e.key.startswith("shardwise::")})
    actions = [str(a) for a in pipe.schedule.actions[0] if a.op.value in ("F", "B", "W")]
    assert sorted(actions) == sorted(f"{s}{op}{mb}" for s in (0, 1) for op in "FB" for mb in (0, 1))
    assert ranges == {f"shardwise::pipeline ({a})": 1 for a in actions}


def test_no_record_function_is_entered_without_a_profiler():
    assert profiler_range("pre_forward", "blocks.0") is profiler_range("finish_backward")  # the shared no-op
    with profile():
        assert isinstance(profiler_range("finish_backward"), torch.profiler.record_function)
