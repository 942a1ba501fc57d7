"""The backward pass split in two, for zero-bubble schedules: I (input gradient) now, W (weight gradients) later.

Zero Bubble Pipeline Parallelism (Qi et al. 2024, arXiv 2401.10241) observes that the previous stage waits only
for the gradient of this stage's *input*; the weight gradients can be computed later, in time that would
otherwise be a bubble. torch.distributed.pipelining does the same split on the autograd graph (its
`stage_backward_input` / `stage_backward_weight`); this is our version of that mechanism.

Mechanism, on the autograd graph of one stage and one microbatch:

1. Mark X, the graph nodes that lie on a path from the output to the stage input. Computing the input gradient
   runs exactly these nodes.
2. An *intermediate* is a node of X with an edge leaving X towards a parameter (e.g. the `addmm` of a Linear: one
   edge to its input, one to its weight). Intermediates that lead to a common parameter form a group.
3. I: a pre-hook on every intermediate saves the gradients flowing into it, then
   ``torch.autograd.grad(output, input, grad_output, retain_graph=True)`` computes the input gradient only
   (autograd skips the weight branches, so e.g. no weight matmul runs).
4. W: for each group, ``torch.autograd.grad`` is started *at* its intermediates (as GradientEdges) with the
   saved gradients, towards the group's parameters: only the weight branches run, giving exactly the gradients a
   full backward would; they are added to ``.grad``. Then every reference is dropped and the graph (with its
   saved activations) is freed.

A stage whose input needs no gradient (the first stage, fed token ids) has no I work: W runs its whole backward.
If a group's intermediates lie on one another's input path (a weight used twice in series), starting at all of
them would count the upstream one twice, so that microbatch falls back to a full backward at W (correct; the
input-gradient work is then done twice).

A structured stage (several outputs carrying gradients, several input leaves requiring grad: hidden states plus
other floating tensors) is one graph with several roots and several input nodes; X is then the nodes on a path
from any output to any input, and step 3 asks for all input gradients at once (None for an unused input).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from ..param_hooks import run_post_accumulate_hooks

__all__ = ["WeightGrad", "backward_input", "backward_inputs"]


def _accumulate(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    """Add each gradient into its parameter's `.grad`, then run the parameter's post-accumulate-grad hooks, as
    autograd's AccumulateGrad does (torch.autograd.grad, which computed them, runs none)."""
    with torch.no_grad():  # autograd runs the hooks with grad mode as the backward's create_graph: off
        for p, g in zip(params, grads):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g.detach()
            else:
                p.grad.add_(g)
            run_post_accumulate_hooks(p)


class WeightGrad:
    """The deferred W pass of one stage and microbatch: `run()` adds the weight gradients to the params' .grad."""

    def __init__(
        self,
        groups: list[tuple[list[GradientEdge], list[torch.Tensor], list[torch.Tensor]]] | None,
        full: tuple[list[torch.Tensor], list[torch.Tensor] | None, list[torch.Tensor]] | None,
    ) -> None:
        self._groups = groups  # (edges to start from, their gradients, params)
        self._full = full  # (outputs, grad_outputs, params) for a full backward at W time

    def run(self) -> None:
        if self._full is not None:
            output, grad_output, params = self._full
            self._full = None
            if params:
                _accumulate(params, _grad(output, params, grad_output))
            return
        groups, self._groups = self._groups or [], None
        for edges, grads, params in groups:
            _accumulate(params, _grad(edges, params, grads))


def _grad(outputs: Sequence, params: Sequence[torch.Tensor], grad_outputs: Sequence | None) -> tuple:
    """torch.autograd.grad of `outputs` with respect to the stage's parameters. A tensor-parallel slice refuses
    that as user code (under ZeRO the piece is not what the forward used; zb_h1 is refused with ZeRO / FSDP), but
    the slice is what its layer computes with, so its gradient is the slice's part of the whole one: here the
    subclass's checks are off (the post-accumulate-grad hooks describe it as the piece again)."""
    with torch._C.DisableTorchFunctionSubclass():
        return torch.autograd.grad(outputs, params, grad_outputs, allow_unused=True)


def _graph(roots: Sequence[Node]) -> tuple[list[Node], dict[Node, list[Node]]]:
    """Every node reachable from the roots in post-order (children before parents) and each node's children.

    The autograd graph is a DAG whose edges point from a node towards the inputs of its forward op.
    """
    children: dict[Node, list[Node]] = {}
    order: list[Node] = []
    stack: list[tuple[Node, bool]] = [(root, False) for root in reversed(roots)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in children:
            continue
        kids = [fn for fn, _ in node.next_functions if fn is not None]
        children[node] = kids
        stack.append((node, True))
        stack.extend((k, False) for k in kids if k not in children)
    return order, children


def _reaching(order: list[Node], children: dict[Node, list[Node]], targets: set[Node]) -> set[Node]:
    """Nodes with a path to any of `targets` (targets included): one pass in post-order."""
    reach: set[Node] = set()
    for node in order:
        if node in targets or any(k in reach for k in children[node]):
            reach.add(node)
    return reach


def backward_input(
    output: torch.Tensor,
    grad_output: torch.Tensor | None,
    input: torch.Tensor | None,
    params: Sequence[torch.Tensor],
) -> tuple[torch.Tensor | None, WeightGrad]:
    """The I pass of a stage with one output and one input: `backward_inputs` for single tensors.

    output: the stage output (or the scaled loss on the last stage, with grad_output None). input: the stage's
    input leaf (None or not requiring grad for the first stage). params: the stage's trainable parameters.
    """
    inputs = [] if input is None or not input.requires_grad else [input]
    grads, weight = backward_inputs([output], None if grad_output is None else [grad_output], inputs, params)
    return (grads[0] if grads else None), weight


def _node(t: torch.Tensor) -> Node:
    """The autograd node `t`'s gradient flows into (its AccumulateGrad for a leaf). torch finds a leaf's through
    ``t.view_as(t)``, which a tensor-parallel or ZeRO piece refuses as user code (it would see one rank's part):
    here it is bookkeeping on the piece itself, so it runs with the subclass's checks off."""
    with torch._C.DisableTorchFunctionSubclass():
        return get_gradient_edge(t).node


def backward_inputs(
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor] | None,
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightGrad]:
    """The I pass: return (gradients of `inputs`, None where one is unused, and the deferred W pass).

    outputs: the stage's output tensors that carry a gradient (or the scaled loss on the last stage, with
    grad_outputs None); inputs: the stage's input leaves that require grad (none on the first stage); params: the
    stage's trainable parameters. See the module docstring; several outputs and inputs are handled as one graph.
    """
    outputs, inputs = list(outputs), list(inputs)
    params = [p for p in params if p.requires_grad]
    if not outputs:
        return [None] * len(inputs), WeightGrad(None, None)
    if not inputs:
        return [], WeightGrad(None, (outputs, grad_outputs, params))
    # An output that is an input passed through unchanged is a leaf without grad_fn: no node of its own.
    roots = [o.grad_fn for o in outputs if o.grad_fn is not None]
    input_nodes = {_node(x) for x in inputs}
    param_nodes = {_node(p): p for p in params}
    order, children = _graph(roots)
    on_input_path = _reaching(order, children, input_nodes)
    to_params = _reaching(order, children, set(param_nodes))

    def input_grads() -> list[torch.Tensor | None]:
        return list(torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph=True, allow_unused=True))

    if not any(root in on_input_path for root in roots):
        return input_grads(), WeightGrad(None, (outputs, grad_outputs, params))

    # Intermediates and the parameters each one reaches through nodes off the input path.
    reached: dict[Node, set[Node]] = {}
    for node in order:  # graph order, not set order: the same plan on every run
        if node not in on_input_path:
            continue
        leaving = [k for k in children[node] if k not in on_input_path and k in to_params]
        if not leaving:
            continue
        found: set[Node] = set()
        stack = list(leaving)
        seen: set[Node] = set()
        while stack:
            k = stack.pop()
            if k in seen:
                continue
            seen.add(k)
            if k in param_nodes:
                found.add(k)
            stack.extend(c for c in children.get(k, ()) if c in to_params and c not in on_input_path)
        reached[node] = found

    # Group intermediates that share a parameter (union-find over parameters).
    parent: dict[Node, Node] = {}

    def find(x: Node) -> Node:
        while parent.setdefault(x, x) is not x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for node, ps in reached.items():
        for p in ps:
            parent[find(p)] = find(node)
    groups: dict[Node, list[Node]] = {}
    for node in reached:
        groups.setdefault(find(node), []).append(node)

    # A group whose intermediates are in series on the input path would be counted twice: fall back.
    for members in groups.values():
        if len(members) > 1:
            member_set = set(members)
            along_input = {k: [c for c in v if c in on_input_path] for k, v in children.items()}
            for m in members:
                above = _reaching(order, along_input, {m})  # nodes whose input path runs through m
                if (above - {m}) & member_set:
                    return input_grads(), WeightGrad(None, (outputs, grad_outputs, params))

    captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    handles = []
    for node in reached:
        def hook(grad_outputs: tuple[torch.Tensor | None, ...], node: Node = node) -> None:
            captured[node] = grad_outputs
        handles.append(node.register_prehook(hook))
    try:
        grad_inputs = input_grads()
    finally:
        for h in handles:
            h.remove()

    if len(captured) != len(reached):  # an intermediate did not run: do not guess, recompute at W
        return grad_inputs, WeightGrad(None, (outputs, grad_outputs, params))
    plan = []
    for members in groups.values():
        edges, grads = [], []
        for node in members:
            for slot, g in enumerate(captured[node]):
                if g is not None:
                    edges.append(GradientEdge(node, slot))
                    grads.append(g)
        wanted = {p for node in members for p in reached[node]}
        group_params = [p for node, p in param_nodes.items() if node in wanted]
        if edges and group_params:
            plan.append((edges, grads, group_params))
    return grad_inputs, WeightGrad(plan, None)
