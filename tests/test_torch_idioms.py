"""torch DDP's own idioms on shardwise's wrappers (issue 29): `model.module` and `require_backward_grad_sync`,
the flag `no_sync()` sets, one mechanism: gradient accumulation written nanoGPT's way reduces once per step and
trains like one process."""

from __future__ import annotations

import threading

import pytest
import torch
from parity import assert_state_close
from torch import nn

import shardwise as sw

_lock = threading.Lock()
X = torch.randn(4, 8, 6, generator=torch.Generator().manual_seed(0))  # 4 micro-batches of 8 rows
WRAPS = {"ddp": lambda m, c: sw.DDP(m, c), "zero2": lambda m, c: sw.ZeRO(m, c, stage=2),
         "zero3": lambda m, c: sw.ZeRO(m, c, stage=3), "fsdp": lambda m, c: sw.FSDP(m, c)}


def build() -> nn.Module:
    with _lock:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))


def _accumulate(model: nn.Module, rows, flag) -> None:
    """nanoGPT's loop: sync only on the last micro-batch, by setting the flag or entering no_sync()."""
    for micro in range(4):
        loss = model(rows(micro)).square().mean() / 4
        if flag:
            model.require_backward_grad_sync = micro == 3
            loss.backward()
        elif micro < 3:
            with model.no_sync():
                loss.backward()
        else:
            loss.backward()


@pytest.mark.parametrize("name", list(WRAPS))
@pytest.mark.parametrize("flag", [True, False], ids=["require_backward_grad_sync", "no_sync"])
def test_accumulation_by_the_flag_reduces_once_and_matches_one_process(name, flag):
    def body(comm):
        model = WRAPS[name](build(), comm)
        assert model.module is model  # in place: the model is its own .module
        with comm.stats.measure() as one:  # the reductions of one synced backward
            model(X[0, :2]).square().mean().backward()
        model.zero_grad()
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
        with comm.stats.measure() as step:
            _accumulate(model, lambda m: X[m, 4 * comm.rank : 4 * comm.rank + 4], flag)
        assert model.require_backward_grad_sync
        opt.step()
        reductions = [s.calls("all_reduce") + s.calls("reduce_scatter") for s in (one, step)]
        return reductions, sw.full_state_dict(model)

    ref = build()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.1)
    for micro in range(4):
        (ref(X[micro]).square().mean() / 4).backward()
    opt.step()
    for (once, accumulated), state in sw.launch(body, 2):
        assert accumulated == once > 0  # one synced backward's reductions, not one set per micro-batch
        assert_state_close(state, ref.state_dict())


def test_a_submodule_named_module_wins():
    def body(comm):
        outer = nn.Module()
        outer.module = nn.Linear(2, 2)
        model = sw.DDP(outer, comm)
        return model.module is outer.module

    assert sw.launch(body, 2) == [True, True]


def test_a_gradient_ddp_did_not_average_is_refused_at_the_step():
    """torch.autograd.grad runs no gradient hook, so DDP never averaged what a script assigns to .grad from it, nor
    what backward passes only under no_sync() left: each rank stepped on its own gradient, silently (0.063 off one
    process after two SGD steps). The optimizer's step raises naming the parameter; a gradient DDP averaged and
    then changed in place (clipping, scaling) steps as before, and so does a second optimizer over other
    parameters of the same model."""
    def body(comm):
        model = sw.DDP(build(), comm)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = X[0, comm.rank * 4:(comm.rank + 1) * 4]
        params = list(model.parameters())
        grads = torch.autograd.grad(model(x).square().mean(), params)
        for p, g in zip(params, grads):
            p.grad = g
        with pytest.raises(RuntimeError, match=r"the gradient of '2.bias' is not one DDP averaged over the 2 ranks"):
            opt.step()
        opt.zero_grad()
        with model.no_sync():
            model(x).square().mean().backward()
        with pytest.raises(RuntimeError, match=r"ran under no_sync\(\) .* and were never averaged over the 2 ranks"):
            opt.step()
        opt.zero_grad()
        model(x).square().mean().backward()
        for p in params:
            p.grad.mul_(0.5)  # in place: still DDP's averaged gradient
        first, last = torch.optim.SGD(params[:2], lr=0.1), torch.optim.SGD(params[2:], lr=0.1)
        first.step()
        last.step()
        return [float(p.detach().sum()) for p in params]

    a, b = sw.launch(body, 2)
    assert a == b  # the replicas stepped together


@pytest.mark.parametrize("name", ["ddp", "zero3"])
def test_a_parameter_added_after_wrapping_is_refused_at_the_step(name):
    """An adapter attached to the wrapped model (PEFT's get_peft_model on it, or a layer set by hand) is in no bucket
    or unit: its gradient stayed each rank's own, silently. The first step of an optimizer holding it raises, naming
    it and the order that works."""
    def body(comm):
        model = WRAPS[name](build(), comm)
        model[0].adapter = nn.Linear(16, 16)  # joins after wrapping
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        model(X[0, comm.rank * 4:(comm.rank + 1) * 4]).square().mean().backward()
        with pytest.raises(ValueError, match=r"\['0.adapter.weight', '0.adapter.bias'\] joined the model after "
                                             rf"{name} wrapped it .* add them before wrapping"):
            opt.step()
        return True

    assert sw.launch(body, 2) == [True, True]


@pytest.mark.parametrize("name", ["ddp", "zero2"])
def test_a_slice_of_a_wrapped_sequential_is_a_plain_sequential(name):
    """`model[:2]` (torch DDP's `model.module[:2]`, a feature extractor for evaluation) of a wrapped nn.Sequential
    failed with "'DDPSequential' object has no attribute '_ddp'": torch builds the slice with the wrapper's class. It
    is a plain nn.Sequential of the same layers, computing what the plain model's slice computes."""
    want = build()[:2](X[0])

    def body(comm):
        model = WRAPS[name](build(), comm)
        head = model[:2]
        with torch.no_grad():
            return type(head), head[0] is model[0], head(X[0])

    for cls, same, got in sw.launch(body, 2):
        assert cls is nn.Sequential and same
        torch.testing.assert_close(got, want.detach())



def _halve_through_data(grads) -> None:
    for g in grads:
        g.data = g.data * 0.5


def _halve_through_a_vector(grads) -> None:  # a piece's view() raises under ZeRO / FSDP, naming sw.full_state_dict
    nn.utils.vector_to_parameters(nn.utils.parameters_to_vector(grads) * 0.5, grads)


@pytest.mark.parametrize("zero_grad", ["set_to_none", "zeroed"])
@pytest.mark.parametrize("name,edit", [(name, _halve_through_data) for name in WRAPS]
                         + [("ddp", _halve_through_a_vector)],
                         ids=[f"{name}-data" for name in WRAPS] + ["ddp-vector_to_parameters"])
def test_old_style_gradient_edits_through_data_train_like_one_process(name, edit, zero_grad):
    """`p.grad.data = p.grad.data * 0.5` (old scripts' clipping and scaling) and `nn.utils.vector_to_parameters(v,
    grads)` (which assigns `.data` of each gradient) re-point the tensor object that is `p.grad`. Under sw.DDP that
    object was the bucket's own view: from the next step on each rank's gradient was written outside the bucket the
    all-reduce averages, and the replicas stepped apart, silently (3.2e-2 off one process after three AdamW steps).
    The bucket hands out an alias and keeps its view, so the edit is the script's and the all-reduce is untouched."""
    def train(model, comm=None):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        for step in range(3):
            opt.zero_grad(set_to_none=zero_grad == "set_to_none")
            rows = X[step] if comm is None else X[step, comm.rank * 4:(comm.rank + 1) * 4]
            model(rows.double()).square().mean().backward()
            edit([p.grad for p in model.parameters()])
            opt.step()
        return model

    ref = train(build().double())
    for state in sw.launch(lambda comm: sw.full_state_dict(train(WRAPS[name](build().double(), comm), comm)), 2):
        for key, want in ref.state_dict().items():
            torch.testing.assert_close(state[key], want, rtol=1e-12, atol=1e-12, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeroed"])
@pytest.mark.parametrize("name", list(WRAPS))
def test_a_step_after_backward_passes_only_under_no_sync_is_refused(name, set_to_none):
    """The last micro-batch's backward run under no_sync() too (a flag set one micro-batch late): nothing reduced the
    gradients. sw.DDP raised only where backward had made new gradient tensors (zero_grad's set_to_none); with
    zero_grad(set_to_none=False) autograd accumulated into the buckets in place and each rank stepped on its own
    gradient (the replicas apart), and under ZeRO / FSDP the pieces never received it: the step skipped it (or used
    zeros), silently. Every wrapper raises at the step now, naming no_sync() and model.sync_gradients(); after
    sync_gradients(), or a synchronised last backward, the step goes on."""
    def body(comm):
        model = WRAPS[name](build(), comm)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        rows = X[0, comm.rank * 4:(comm.rank + 1) * 4]
        model(rows).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        with model.no_sync():
            model(rows).square().mean().backward()
        with pytest.raises(RuntimeError, match=r"optimizer.step\(\): .*under no_sync\(\) \(or "
                                               r"require_backward_grad_sync=False\)"):
            opt.step()
        model.sync_gradients()  # what the message offers: the accumulated gradients reduced now
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        with model.no_sync():
            model(rows).square().mean().backward()
        model(rows).square().mean().backward()  # the last micro-batch synchronised: the step goes on
        opt.step()
        return True

    assert sw.launch(body, 2) == [True, True]
