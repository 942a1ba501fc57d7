"""`torch.func.functional_call(model, tensors, args)` on a wrapped model computes with the caller's tensors, as in one
process: evaluating another set of weights (an EMA, a model soup, a checkpoint) without copying them in, or taking
gradients with respect to them. The sharding engine swaps each unit's gathered parameters into the modules in its
forward hooks; it used to overwrite the tensors functional_call had swapped in, so every ZeRO/FSDP layout computed
with the model's own weights, silently (0.71 off on this model). Training around such calls still matches one
process.

References are computed: the same calls on the plain model in one process."""

from __future__ import annotations

import threading

import pytest
import torch
from parity import assert_state_close, mlp_batch, small_mlp
from torch import nn
from torch.func import functional_call

import shardwise as sw

_BUILD = threading.Lock()  # thread ranks share torch's global RNG: one seeded build at a time


def build() -> nn.Module:
    with _BUILD, torch.random.fork_rng():
        torch.manual_seed(0)
        return small_mlp()


def other_weights(model: nn.Module, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Another set of whole weights for `model` (plain, one process's), all of them or those named."""
    state = build().state_dict()
    return {k: v * 0.5 + 0.1 for k, v in state.items() if names is None or k in names}


WRAPS = {
    "ddp": lambda m, c: sw.DDP(m, c),
    "zero1": lambda m, c: sw.ZeRO(m, c, stage=1),
    "zero2": lambda m, c: sw.ZeRO(m, c, stage=2),
    "zero3": lambda m, c: sw.ZeRO(m, c, stage=3),
    "zero3-per-layer": lambda m, c: sw.ZeRO(m, c, stage=3, wrap=nn.Linear),
    "fsdp": lambda m, c: sw.FSDP(m, c),
    "fsdp-per-layer": lambda m, c: sw.FSDP(m, c, wrap=nn.Linear),
}


def session(model: nn.Module, names: list[str] | None, rank: int = 0, world: int = 1) -> dict[str, torch.Tensor]:
    """Two AdamW steps, an evaluation of other weights, the gradient with respect to them, two more steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-5)
    given = other_weights(model, names)
    x_all = mlp_batch(99)[0]  # the whole evaluation batch on every rank
    seen = {}
    for step in range(4):
        if step == 2:
            with torch.no_grad():
                seen["eval"] = functional_call(model, given, (x_all,)).clone()
            leaves = {k: v.clone().requires_grad_() for k, v in given.items()}
            out = functional_call(model, leaves, (x_all,))
            grads = torch.autograd.grad(out.pow(2).sum(), list(leaves.values()))
            seen.update({f"grad:{k}": g for k, g in zip(leaves, grads)})
        x, y = mlp_batch(step, rank, world)
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return seen


@pytest.mark.parametrize("names", [None, ["4.weight", "4.bias"]], ids=["every-weight", "the-head-only"])
@pytest.mark.parametrize("wrap", list(WRAPS))
def test_functional_call_computes_with_the_given_tensors(wrap: str, names: list[str] | None) -> None:
    plain = build()
    want = session(plain, names)
    want_state = {k: v.clone() for k, v in plain.state_dict().items()}

    def body(comm: sw.Communicator) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        model = WRAPS[wrap](build(), comm)
        seen = session(model, names, comm.rank, comm.size)
        return seen, {k: v.clone() for k, v in sw.full_state_dict(model).items()}

    for seen, state in sw.launch(body, 2):
        assert_state_close(seen, want)
        assert_state_close(state, want_state)
