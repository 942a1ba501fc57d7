"""The I/W split of the backward pass: same gradients as a full backward, W deferred, graph freed after W."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn

from shardwise.models import GPT, GPTConfig
from shardwise.pipeline.split_backward import backward_input, backward_inputs

CONFIG = GPTConfig.preset("tiny", n_layers=2)


class _Twice(nn.Module):
    """One Linear applied twice in series: its two uses lie on each other's input path (the fallback case)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


class _Mixed(nn.Module):
    """Parameters used off the input path, on it, and both."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(8))
        self.b = nn.Parameter(torch.randn(8))
        self.lin = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        return self.lin(x * self.a) + self.b.exp() + (self.a * 2).sum()


def _stage(kind):
    torch.manual_seed(0)
    layers = GPT(CONFIG, seed=0).pipeline_layers()
    return {"embed": layers[0], "block": layers[1], "head": layers[-1], "blocks+head": nn.Sequential(*layers[1:]),
            "twice": _Twice(), "mixed": _Mixed()}[kind]


def _input(kind):
    g = torch.Generator().manual_seed(1)
    if kind == "embed":
        return torch.randint(0, CONFIG.vocab_size, (2, 8), generator=g)
    if kind in ("twice", "mixed"):
        return torch.randn(3, 8, generator=g, requires_grad=True)
    return torch.randn(2, 8, CONFIG.d_model, generator=g, requires_grad=True)


@pytest.mark.parametrize("kind", ["embed", "block", "head", "blocks+head", "twice", "mixed"])
def test_input_then_weight_pass_equals_full_backward(kind):
    full, split = _stage(kind), _stage(kind)
    x_full = _input(kind)
    x_split = x_full.detach().clone().requires_grad_(x_full.requires_grad)
    y = full(x_full)
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
    y.backward(grad)

    out = split(x_split)
    grad_input, weight_pass = backward_input(out, grad, x_split, list(split.parameters()))
    del out
    assert all(p.grad is None for p in split.parameters())  # I computed no weight gradient
    if x_full.requires_grad:
        torch.testing.assert_close(grad_input, x_full.grad, rtol=0, atol=0)
    else:
        assert grad_input is None
    weight_pass.run()
    for (name, want), got in zip(full.named_parameters(), split.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_split_path_defers_weight_work_and_falls_back_only_when_needed():
    stage = _stage("block")
    x = _input("block")
    _, weight_pass = backward_input(stage(x), torch.ones(2, 8, CONFIG.d_model), x, list(stage.parameters()))
    assert weight_pass._full is None and len(weight_pass._groups) == 6  # one per Linear (4) and LayerNorm (2)
    twice = _stage("twice")
    x = _input("twice")
    _, weight_pass = backward_input(twice(x), torch.ones(3, 8), x, list(twice.parameters()))
    assert weight_pass._full is not None


def test_saved_activations_are_freed_after_the_weight_pass():
    live = weakref.WeakSet()

    class Saved:
        def __init__(self, t):
            self.t = t

    def pack(t):
        holder = Saved(t.detach())  # detached: holding an output with its grad_fn would make a reference cycle
        live.add(holder)
        return holder

    stage = _stage("block")
    x = _input("block")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.t):
        out = stage(x)
    assert len(live) > 10
    _, weight_pass = backward_input(out, torch.ones_like(out), x, list(stage.parameters()))
    del out
    assert len(live) > 0  # W still needs the layers' inputs
    weight_pass.run()
    del weight_pass
    assert len(live) == 0


class _Structured(nn.Module):
    """A structured stage: three floating inputs (one unused) and three outputs, one of them an input passed
    through unchanged (a leaf without grad_fn)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.randn(8))

    def forward(self, h, b, unused):
        return self.lin(h) * torch.tanh(b), b * self.scale, h


def test_several_outputs_and_inputs_split_like_a_full_backward():
    torch.manual_seed(0)
    full, split = _Structured(), _Structured()
    split.load_state_dict(full.state_dict())
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(3, 8, generator=g) for _ in range(3)]
    grads = [torch.randn(3, 8, generator=g) for _ in range(3)]
    x_full = [x.clone().requires_grad_(True) for x in xs]
    torch.autograd.backward(list(full(*x_full)), grads)

    x_split = [x.clone().requires_grad_(True) for x in xs]
    got, weight_pass = backward_inputs(list(split(*x_split)), grads, x_split, list(split.parameters()))
    assert all(p.grad is None for p in split.parameters())
    assert got[2] is None and x_full[2].grad is None  # the unused input has no gradient
    for have, want in zip(got[:2], x_full[:2]):
        torch.testing.assert_close(have, want.grad, rtol=0, atol=0)
    weight_pass.run()
    for (name, want), have in zip(full.named_parameters(), split.parameters()):
        torch.testing.assert_close(have.grad, want.grad, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
