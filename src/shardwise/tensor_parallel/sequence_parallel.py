"""Sequence parallelism: replicated parameters used on sequence shards, and measuring the activation memory saved.

Korthikanti et al. (2022), "Reducing Activation Recomputation in Large Transformer Models", section 4.2.2: between
the row-parallel layer that closes one tensor-parallel region and the column-parallel layer that opens the next,
plain tensor parallelism leaves every rank computing the same LayerNorm, dropout and residual add on the whole
sequence, and keeping the same activations for backward. Sequence parallelism runs those regions on 1/tp of the
sequence instead: the closing all-reduce becomes a reduce-scatter along the sequence dim and the opening identity
becomes an all-gather (see `mappings.py`), so the traffic is unchanged while the activations kept for backward by
the LayerNorms (their inputs and statistics), the dropout masks and the residual stream shrink by tp.

The parameters of those regions (LayerNorm weight and bias, a row-parallel layer's bias, a position embedding) stay
replicated, but each rank now sees only its shard of the tokens, so each rank's gradient is a partial sum over the
sequence. :func:`reduce_sequence_parallel_grads` registers a gradient hook that all-reduces (sums) it over the
tensor-parallel group before it is accumulated into ``.grad``; Megatron-LM does the same for parameters it marks
``sequence_parallel`` (it all-reduces them after backward). Reducing the incoming gradient, not ``.grad``, keeps
gradient accumulation correct: each micro-batch's contribution is summed once.

The same hook serves the "heads" regions (a per-head norm running on this rank's heads). Its first call checks that
the ranks' contributions differ (replica_grads.check_partial): a module declared so that in fact runs on the whole,
replicated activations gives every rank the same gradient, which the sum would count tp times, silently.

Dropout: inside a sequence-parallel region each rank draws masks for its own tokens; in the replicated regions every
rank draws the same ones (dropout_stream.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from ..comm.base import Communicator, ReduceOp
from ..param_hooks import hook_even_if_frozen
from .replica_grads import check_partial

__all__ = ["reduce_sequence_parallel_grads", "register_partial_grad_sum", "is_sequence_parallel_param",
           "SavedActivations", "saved_activations"]

_MARK = "_shardwise_sequence_parallel"


def register_partial_grad_sum(param: torch.Tensor, comm: Communicator, where: str = "") -> None:
    """Sum `param`'s incoming gradient over `comm` before it is accumulated (sequence-parallel weights).

    A hook on the incoming gradient rather than on .grad keeps accumulation right: each backward's contribution is
    summed once. Strategies that replace parameter objects (the sharding engine) re-register it on their own. Until
    a nonzero contribution was seen, the hook first checks it is a partial one (`check_partial`; `where` names the
    module in its error).
    """
    checked = [False]

    def hook(grad: torch.Tensor) -> torch.Tensor:
        out = grad.contiguous().clone()  # autograd may hold the incoming gradient elsewhere
        if not checked[0]:
            checked[0] = check_partial(out, comm, where)
        comm.all_reduce(out, ReduceOp.SUM)
        return out

    hook_even_if_frozen(param, "register_hook", hook)


def reduce_sequence_parallel_grads(params: Iterable[nn.Parameter], comm: Communicator,
                                   where: str = "") -> list[nn.Parameter]:
    """Make every parameter in `params` all-reduce (sum) its incoming gradient over `comm` in backward.

    Use it for replicated parameters that act on sequence shards. Each parameter is marked (see
    :func:`is_sequence_parallel_param`) and hooked once, however often it is passed. Returns the newly hooked ones.
    """
    hooked = []
    if comm.size == 1:
        return hooked
    for p in params:
        if not (p.is_floating_point() or p.is_complex()) or getattr(p, _MARK, False):
            continue  # a frozen one too: a script may unfreeze it after wrapping
        register_partial_grad_sum(p, comm, where)
        setattr(p, _MARK, True)
        hooked.append(p)
    return hooked


def is_sequence_parallel_param(p: torch.Tensor) -> bool:
    """True if `p`'s gradient is all-reduced over the tensor-parallel group by a sequence-parallel hook."""
    return bool(getattr(p, _MARK, False))


@dataclasses.dataclass
class SavedActivations:
    """Bytes of the tensors autograd saved for backward inside a :func:`saved_activations` block.

    total: unique storages (a tensor and its views count once), parameters excluded. by_module: the same, split by
    the innermost module (of the ``model`` given) whose forward was running when the tensor was saved; a storage is
    attributed to the first module that saved it.
    """

    total: int = 0
    by_module: dict[str, int] = dataclasses.field(default_factory=dict)


@contextlib.contextmanager
def saved_activations(model: nn.Module | None = None) -> Iterator[SavedActivations]:
    """Count the activation memory kept for backward by the forward passes run inside the block.

    A ``saved_tensors_hooks`` pack hook sees every tensor autograd stores for backward; storages are deduplicated
    and parameters of `model` are skipped (they are not activations). With `model`, bytes are also attributed to its
    modules (forward pre/post hooks track which module is running). The hooks are thread-local, so each thread rank
    measures its own forward.
    """
    result = SavedActivations()
    seen: set[int] = set()
    skip: set[int] = set()
    stack: list[str] = []
    handles = []
    if model is not None:
        skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
        def enter(name: str):  # noqa: ANN202 - hooks must return None, or they replace inputs / outputs
            def hook(module: nn.Module, args: tuple) -> None:
                stack.append(name)
            return hook

        def leave(module: nn.Module, args: tuple, output: object) -> None:
            stack.pop()

        for name, module in model.named_modules():
            handles.append(module.register_forward_pre_hook(enter(name)))
            handles.append(module.register_forward_hook(leave))

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        # A parameter, or a view of one (a Linear saves its weight transposed; a sharding engine's gathered
        # parameters are parameters viewing its full buffer), is not an activation.
        is_param = isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)
        if key not in seen and key not in skip and not is_param:
            seen.add(key)
            result.total += storage.nbytes()
            where = stack[-1] if stack else ""
            result.by_module[where] = result.by_module.get(where, 0) + storage.nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield result
    finally:
        for h in handles:
            h.remove()
