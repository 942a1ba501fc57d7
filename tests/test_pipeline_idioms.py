"""torch's clip and GradScaler over a pipeline-parallel model raise naming the shardwise way (each rank holds only
some layers, so its own norm or overflow check would be wrong with no error); the optimizer steps as it is
(pipeline/stage_grads.py). Parity of pipeline training itself: tests/test_pipeline_compose.py, test_hybrid.py."""

from __future__ import annotations

import pytest
import torch
from parity import CONFIG, batch

import shardwise as sw
from shardwise.models import GPT
from shardwise.sharded_tensor import is_sharded, spec_of


@pytest.mark.parametrize("dp_strategy", ["ddp", "zero2"])
def test_torch_clip_and_grad_scaler_refuse_a_pipeline_stage_and_sw_clip_trains_like_one_process(dp_strategy):
    plain = GPT(CONFIG, seed=0)
    x, y = batch(0)
    plain(x, y).backward()
    want_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e9)

    def body(comm):
        mesh = sw.Mesh(comm, dp=2, pp=2)
        model = sw.parallelize(GPT(CONFIG, seed=0), mesh, dp_strategy=dp_strategy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-5)
        xs, ys = x.chunk(2)[mesh.coords.dp], y.chunk(2)[mesh.coords.dp]
        model.step(xs, ys)
        with pytest.raises(RuntimeError, match=r"sw\.clip_grad_norm_"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(torch.ones(()))  # what a loop scales its loss with
        with pytest.raises(RuntimeError, match=r"sw\.ShardedGradScaler"):
            scaler.unscale_(opt)
        described = all(is_sharded(p.grad) for p in model.parameters() if p.grad is not None)
        # A per-parameter figure of a whole gradient (DDP's, a tied weight's; ZeRO's others are pieces) is allowed,
        # as in one process.
        whole = [p.grad for p in model.parameters() if p.grad is not None and spec_of(p.grad).whole]
        assert whole and all(torch.isfinite(g.norm()) for g in whole)
        norm = sw.clip_grad_norm_(model, 1e9)  # one process's norm, over every stage
        opt.step()
        return described, float(norm)

    for described, norm in sw.launch(body, 4):
        assert described
        assert norm == pytest.approx(float(want_norm), rel=1e-5)


@pytest.mark.parametrize("layout", ["pp2", "dp2-pp2-zero3", "tp2-pp2"])
def test_named_parameters_are_the_plain_model_s(layout):
    """`model.named_parameters()` of what `sw.parallelize` returns names this rank's parameters as the plain model
    does (before: the stage path, `pipe.stages.0.1.attn.qkv.weight` for `blocks.0.attn.qkv.weight`, so a script that
    froze `blocks.0` by name froze nothing, silently), in the plain model's order (the last stage's copy of the
    embedding tied to the head comes where the head is), the same objects `parameters()` gives the optimizer; the
    pipeline ranks together hold every name."""
    plain = [name for name, _ in GPT(CONFIG, seed=0).named_parameters()]
    sizes = {"pp2": {"dp": 1, "pp": 2}, "dp2-pp2-zero3": {"dp": 2, "pp": 2}, "tp2-pp2": {"dp": 1, "tp": 2, "pp": 2}}

    def body(comm):
        mesh = sw.Mesh(comm, **sizes[layout])
        model = sw.parallelize(GPT(CONFIG, seed=0), mesh, dp_strategy="zero3" if "zero3" in layout else "ddp",
                               tp_plan="gpt" if "tp2" in layout else None)
        named = list(model.named_parameters())
        assert [p for _, p in named] == list(model.parameters())
        assert list(model.named_parameters(prefix="m")) == [(f"m.{n}", p) for n, p in named]
        assert list(model.named_parameters(recurse=False)) == []
        return [name for name, _ in named]

    names = sw.launch(body, 4 if layout != "pp2" else 2)
    for mine in names:  # the plain model's names, in its order, but for the head's copy of the tied embedding
        untied = [n for n in mine if n != "tok_emb.weight" or mine.index(n) == 0]
        assert untied == [n for n in plain if n in untied] and len(set(mine)) == len(mine)
    assert set().union(*names) == set(plain)


def _bn_layers():
    g = torch.Generator().manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(4, 8, bias=False), torch.nn.BatchNorm1d(8), torch.nn.ReLU()),
              torch.nn.Linear(8, 1)]
    with torch.no_grad():
        for p in (p for layer in layers for p in layer.parameters()):
            p.copy_(torch.randn(p.shape, generator=g))
    return layers


def _bn_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)


def _mse(out, target):
    return ((out - target) ** 2).mean()


def test_batch_norm_in_training_mode_over_microbatches_is_refused_on_every_rank():
    """Each microbatch would be normalised by its own statistics, one process by the whole batch's: refused on
    both pipeline ranks (the one holding the layer names it; the other is told by an all-reduce, not left waiting)."""
    def body(comm):
        pipe = sw.pipeline.Pipeline(sw.pipeline.partition(_bn_layers(), 2), comm, "1f1b", n_microbatches=2,
                                    loss_fn=_mse)
        with pytest.raises(ValueError, match=r"would normalise by one microbatch \(1/2 of the batch\)") as info:
            pipe.step(*_bn_batch())
        return str(info.value)

    messages = sw.launch(body, 2, timeout=30)
    assert "BatchNorm1d 'stage 0: 0.1'" in messages[0]
    assert "another pipeline rank's stage" in messages[1]


def test_batch_norm_in_eval_mode_over_microbatches_trains_as_one_process():
    layers = _bn_layers()
    plain = torch.nn.Sequential(*layers).eval()
    x, y = _bn_batch()
    want = _mse(plain(x), y).item()

    def body(comm):
        pipe = sw.pipeline.Pipeline(sw.pipeline.partition(_bn_layers(), 2), comm, "1f1b", n_microbatches=2,
                                    loss_fn=_mse)
        pipe.eval()  # a frozen BatchNorm: running statistics, the same for every sample
        return float(pipe.step(*_bn_batch()))

    assert sw.launch(body, 2) == pytest.approx([want, want], rel=1e-6)


class _Counted(torch.nn.Module):
    """Counts its forwards in a buffer: one per step in one process, one per microbatch in a pipeline."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.training:
            self.calls += 1
        return x


def _counted_layers():
    g = torch.Generator().manual_seed(0)
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    with torch.no_grad():
        for p in (*first.parameters(), *second.parameters()):
            p.copy_(torch.randn(p.shape, generator=g))
    return [first, torch.nn.Tanh(), _Counted(), second]


@pytest.mark.parametrize("n_microbatches, choice", [(2, None), (2, "local"), (1, None)])
def test_a_buffer_written_once_per_microbatch_is_refused_on_every_rank(n_microbatches, choice):
    """The counter would count 2 per step where one process counts 1: refused on both pipeline ranks at the first
    step (the rank holding it names it); with one microbatch, or buffer_writes='local', the step runs."""
    def body(comm):
        layers = _counted_layers()
        pipe = sw.pipeline.Pipeline(sw.pipeline.partition(layers, 2), comm, "gpipe", n_microbatches=n_microbatches,
                                    loss_fn=_mse, buffer_writes=choice)
        try:
            pipe.step(*_bn_batch())
        except ValueError as e:
            return str(e)
        return int(layers[2].calls)

    got = sw.launch(body, 2, timeout=30)
    if n_microbatches == 2 and choice is None:
        assert "was written by the forward of each of the 2 microbatches" in got[0] + got[1]
        assert "buffer 'stage 1: 1.calls'" in got[0] + got[1] and "another pipeline rank's stage" in got[0] + got[1]
    else:
        assert n_microbatches in got  # the holding rank's counter: one per microbatch
