"""A pipeline composed by hand (pp.Pipeline, then DDP or ZeRO over each local stage, per-microbatch reduction) with
the GPT's embedding and head tied across pipeline ranks trains like one process: the pipeline declares the tie, so
ZeRO keeps that weight whole and the copies' gradients are summed. A raw pipeline's checkpoint reloads into the
same layout, and clipping counts the tied weight once."""

from __future__ import annotations

import pytest
import torch
from compose_cases import dense_clipped, optimizer
from parity import CONFIG, RTOL, batch
from sharding_cases import wrap

import shardwise as sw
from shardwise import pipeline as pp
from shardwise.checkpoint import read_tensors
from shardwise.models import GPT
from shardwise.models.gpt import lm_loss

MAX_NORM = 0.3


def build(comm, strategy):
    mesh = sw.Mesh(comm, dp=2, pp=2)
    pipe = pp.Pipeline(pp.partition(GPT(CONFIG, seed=0).pipeline_layers(), 2), mesh.pp, "1f1b", 4, lm_loss)
    for stage in pipe.stages.values():
        sw.DDP(stage, mesh.dp) if strategy == "ddp" else wrap(stage, mesh.dp, strategy, wrap="auto")
    return pipe, mesh


def train(comm, strategy, steps, load=None, save=None):
    pipe, mesh = build(comm, strategy)
    opt = optimizer(pipe.parameters())
    start = sw.load_checkpoint(load, pipe, opt, comm=comm)["step"] if load else 0
    for step in range(start, start + steps):
        x, y = batch(step, mesh.coords.dp, 2)
        pipe.step(x, y)
        sw.clip_grad_norm_(pipe, MAX_NORM)
        opt.step()
        opt.zero_grad()
    if save:
        sw.save_checkpoint(save, pipe, opt, step=start + steps, comm=comm)
    return sw.full_state_dict(pipe)


def expected(model):
    """The dense model's tensors under the pipeline's names (stages.<s>.<name within the stage>)."""
    out = {}
    for stage in pp.partition(model.pipeline_layers(), 2):
        out.update({f"stages.{stage.index}.{n}": p.detach() for n, p in stage.named_parameters()})
    return out


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero3"])
def test_hand_composed_pipeline_with_tied_weights_matches_one_process(strategy, tmp_path):
    want = expected(dense_clipped(5, MAX_NORM))
    for state in sw.launch(train, 4, strategy, 3, None, tmp_path):
        assert state.keys() == want.keys()
    tensors = read_tensors(tmp_path)
    assert "param/stages.0.0.tok_emb.weight" in tensors and "param/stages.1.1.head.weight" in tensors
    for state in sw.launch(train, 4, strategy, 2, tmp_path):  # reload into the same layout, 2 more steps
        for name in want:
            torch.testing.assert_close(state[name], want[name], rtol=RTOL, atol=1e-5, msg=lambda m: f"{name}: {m}")
