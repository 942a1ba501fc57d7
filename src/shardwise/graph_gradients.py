"""Gradients that build a graph (`create_graph=True`) under data parallelism: penalties on a gradient.

Some losses contain a gradient. A gradient penalty on the inputs (WGAN-GP, Gulrajani et al. 2017; StyleGAN's R1,
Mescheder et al. 2018; physics-informed networks, Raissi et al. 2019) takes `torch.autograd.grad(out, x,
create_graph=True)` and backpropagates through it; a penalty on the parameters' gradient (gradient-norm
regularisation, Barrett & Dherin 2021, "Implicit Gradient Regularization"; Hessian-vector products) takes
`torch.autograd.grad(loss, model.parameters(), create_graph=True)`. Two things make that differ from one process
under data parallelism:

* **The parameters' gradient is this rank's.** `autograd.grad` runs no reduction hook, so it returns the gradient of
  this rank's slice of the batch, and a penalty of it (a square, a norm) is not the penalty of the global batch's
  gradient. `average_when_building_graph` is a tensor hook on each parameter autograd sees: while a backward builds
  a graph (grad mode is on inside it exactly then), it replaces the gradient by its average over the data-parallel
  groups, differentiably: the average in the forward, the average of the upstream gradient in the backward. Every
  rank then holds the global batch's gradient, each computes the same penalty from it, and the usual averaging of
  the second backward's parameter gradients gives one process's `d(loss + penalty)/dθ`: on rank r the penalty
  adds `H_r · dP/dg`, whose average over ranks is `H · dP/dg`. In a backward that builds no graph the hook does
  nothing (one Python call per parameter).
* **Gathered parameters must outlive the first backward.** ZeRO-3 / FSDP free a unit's gathered parameters after
  its backward; the graph built by `create_graph=True` holds them, and its backward then read freed storage.
  `KeptGraph` tells the engine to keep every gathered parameter until a backward that builds no graph has ended
  (the one through the penalty): that step runs with the whole model gathered, as under ZeRO-2.

The autograd Functions that communicate (tensor parallel's mappings and linear layers, its vocabulary-parallel
cross-entropy, ring and Ulysses attention, the expert all-to-all, `sw.SyncBatchNorm`) are differentiated once: their
backward moves gradients between ranks outside autograd's sight, so a graph built through it would miss the other
ranks' share of the second derivative (a gradient penalty under tensor parallel was 0.028 off one process). Each
calls `refuse_second_order` first, which raises in a backward with `create_graph=True`.

`loss.backward(create_graph=True)` accumulates a `.grad` that carries a graph; the reducers replace `.grad` by
buffers of their own, which would cut that graph silently, so it is refused (`refuse_graph_accumulation`), naming
`torch.autograd.grad(..., create_graph=True)`, which works.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .comm.base import Communicator, ReduceOp

__all__ = ["KeptGraph", "average_when_building_graph", "refuse_graph_accumulation", "refuse_second_order"]


class _AverageWithGraph(torch.autograd.Function):
    """`grad` averaged over `comms` (in order), differentiably: the backward averages the upstream gradient, since
    every rank computes the same penalty from the average and the reducers average what each rank's backward
    gives."""

    @staticmethod
    def forward(ctx: Any, grad: torch.Tensor, comms: tuple[Communicator, ...]) -> torch.Tensor:
        ctx.comms = comms
        return _average(grad, comms)

    @staticmethod
    def backward(ctx: Any, upstream: torch.Tensor) -> tuple[torch.Tensor, None]:
        refuse_second_order("the data-parallel average of a gradient built with create_graph=True (a third "
                            "derivative)")
        return _average(upstream, ctx.comms), None


def _average(tensor: torch.Tensor, comms: tuple[Communicator, ...]) -> torch.Tensor:
    out = tensor.detach().clone(memory_format=torch.contiguous_format)
    for comm in comms:
        comm.all_reduce(out, ReduceOp.AVG)
    return out


def average_when_building_graph(comms: Sequence[Communicator | None]) -> Callable[[torch.Tensor], Any]:
    """A tensor hook (`param.register_hook`) that, in a backward with `create_graph=True`, returns the gradient
    averaged over the data-parallel `comms` (None and groups of one are skipped), and otherwise leaves it be."""
    groups = tuple(c for c in comms if c is not None and c.size > 1)

    def hook(grad: torch.Tensor) -> torch.Tensor | None:
        if not groups or not torch.is_grad_enabled():
            return None
        return _AverageWithGraph.apply(grad, groups)

    return hook


def refuse_graph_accumulation(who: str, name: str) -> None:
    """Raise when a backward with `create_graph=True` accumulates a parameter's `.grad` (module docstring)."""
    if torch.is_grad_enabled():
        raise ValueError(f"{who}: backward(create_graph=True) accumulated a gradient into {name}.grad, which "
                         f"{who} replaces by its reduced buffer, cutting the graph that gradient carries. For a "
                         f"penalty on gradients use torch.autograd.grad(loss, params, create_graph=True) (averaged "
                         f"over the data-parallel ranks with its graph), then (loss + penalty).backward()")


def refuse_second_order(what: str) -> None:
    """Raise in the backward of an autograd Function that communicates when that backward builds a graph (module
    docstring); `what` names the Function for the user."""
    if torch.is_grad_enabled():
        raise ValueError(f"{what} is differentiated once only: a backward with create_graph=True through it (a "
                         f"gradient penalty, torch.autograd.grad(..., create_graph=True)) would miss the other "
                         f"ranks' share of the second derivative. Gradient penalties are exact under data "
                         f"parallelism alone (sw.DDP, sw.ZeRO, sw.FSDP)")


class KeptGraph:
    """Whether gathered parameters must stay gathered because a backward built a graph that holds them (module
    docstring). `begin_backward` at the start of each backward; `keeps` while any such graph may be alive;
    `end_backward` at its end."""

    def __init__(self) -> None:
        self.building = False  # the backward now running has create_graph=True
        self.keeps = False

    def begin_backward(self) -> None:
        self.building = torch.is_grad_enabled()
        self.keeps = self.keeps or self.building

    def end_backward(self) -> None:
        """A backward that built no graph consumed what the earlier ones built: gathered parameters may go."""
        if not self.building:
            self.keeps = False
