"""The first optimizer steps of a tensor-parallel model check that every replicated parameter got the same gradient
on every rank of the group, and raise, naming it, when one did not.

Why. Tensor parallel keeps the parameters the plan leaves whole (norms, biases after a row-parallel layer, position
embeddings) as copies on every rank, and nothing reduces their gradients: the copies stay equal only because every
rank computes the same gradient from the same replicated activations. A module with parameters that runs on this
rank's *part* of the activations breaks that without an error: a per-head norm inside a split attention (Phi's
``q_layernorm``, Gemma 3's and Qwen 3's ``q_norm``) sees only this rank's heads, so its gradient is a partial sum,
different on every rank; the copies then drift apart from the first step, and training goes on with a model that
is none of them. The built-in plans place such modules ("heads", "split_norm", "head_rows"); a plan dict written by
hand (or copied from HuggingFace's ``base_model_tp_plan``, which lists only the projections) easily leaves one out,
and so does a "sequence" region forgotten under sequence parallel.

Mechanism. The strategy declares this check as its `before_step` (layout.Parallelized), which the optimizer guard
runs before a step over the model's parameters, on every rank of the group at the same point. Each rank packs, for
every parameter replicated over the group (this rank's piece of it under ZeRO / FSDP), ``[g, -g]`` and a
has-a-gradient flag ``[f, -f]`` into one buffer, and one MAX all-reduce gives every rank the elementwise maximum and
minimum over the group (in chunks of at most 16 M elements). A parameter whose spread ``max - min`` exceeds
``tol x max|g|`` (1e-5 in float32 / float64: copies computed alike are bit-equal on CPU, and GPU atomics differ far
less; 4 x the epsilon of bfloat16 / float16), or whose gradient exists on some ranks only, is a ValueError naming
it and the styles that would place it. A parameter with a non-finite spread (a GradScaler's overflow step) or no
gradient anywhere waits for a later step; the check stops once every parameter was compared, or after
`MAX_STEPS` steps. Cost: one pass over the replicated gradients and one all-reduce of twice their size, on the
first step only (on CPU, a few ms for a small model), not counted in ``comm.stats`` (control traffic, as the other
consistency checks: comm/uncounted.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn

from .. import layout
from ..comm.base import Communicator, ReduceOp
from ..comm.uncounted import uncounted
from ..placement import comm_device
from ..sharded_tensor import local

__all__ = ["ReplicatedGradCheck", "stages_check", "check_partial", "MAX_STEPS"]

#: Steps after which the check gives up on parameters it could not compare yet (no gradient, or non-finite ones).
MAX_STEPS = 8
_CHUNK = 1 << 24  # elements of gradient per all-reduce (the buffer holds twice that, plus flags)


def _group_max_min(flat: torch.Tensor, comm: Communicator) -> tuple[torch.Tensor, torch.Tensor]:
    """The elementwise maximum and minimum of `flat` (float32) over `comm`: one MAX all-reduce of ``[x, -x]``,
    control traffic that comm.stats does not count (comm/uncounted.py)."""
    buffer = torch.cat([flat, -flat])
    with uncounted(comm):
        comm.all_reduce(buffer, ReduceOp.MAX)
    return buffer[:flat.numel()], -buffer[flat.numel():]


def _spread_and_scale(high: torch.Tensor, low: torch.Tensor) -> tuple[float, float]:
    """max(high - low), the largest difference between ranks, and max |value|, the scale it is judged against."""
    if not high.numel():
        return 0.0, 0.0
    return float((high - low).max()), float(torch.maximum(high.abs(), low.abs()).max())


def _tolerance(dtype: torch.dtype) -> float:
    return max(1e-5, 4 * torch.finfo(dtype).eps) if dtype.is_floating_point else 0.0


class ReplicatedGradCheck:
    """`before_step` of a model split over `comm` (see the module docstring): call it with the ids of the
    parameters an optimizer is about to step. placements: the model's current placements (`layout.placements`,
    read at each call: a data-parallel strategy wrapping the model later replaces its parameters by pieces)."""

    def __init__(self, placements: Callable[[], dict[str, layout.Placement]], comm: Communicator) -> None:
        self._placements = placements
        self._comm = comm
        self._done: set[str] = set()  # canonical names compared already
        self._steps = 0

    def __call__(self, held: set[int]) -> None:
        if self._steps >= MAX_STEPS:
            return
        left = [pl for pl in self._placements().values()
                if pl.name not in self._done and pl.param.is_floating_point()
                and any(g is self._comm for g in pl.replicated_over)]
        if not left:  # every replicated parameter compared: later steps pay one comparison, not a placements walk
            self._steps = MAX_STEPS
            return
        pending = [pl for pl in left if id(pl.param) in held]
        if not pending:
            return
        self._steps += 1
        problems: list[str] = []
        chunk: list[layout.Placement] = []
        size = 0
        for pl in pending:
            chunk.append(pl)
            size += local(pl.param).numel()
            if size >= _CHUNK:
                problems += self._compare(chunk)
                chunk, size = [], 0
        if chunk:
            problems += self._compare(chunk)
        if problems:
            self._steps = MAX_STEPS  # raised once: a script that catches it is not stopped again at every step
            ranks = list(getattr(self._comm, "global_ranks", range(self._comm.size)))
            raise ValueError(
                f"tensor parallel: replicated parameters got different gradients on the ranks of the tensor-parallel "
                f"group (ranks {ranks}): {'; '.join(problems[:8])}{' ...' if len(problems) > 8 else ''}. The plan "
                f"leaves their modules whole, a copy on every rank, and nothing sums their gradients, so each copy "
                f"would train on its own gradient and the copies drift apart from this step: the module runs on this "
                f"rank's part of the activations (a per-head norm inside a split attention, such as q_norm / "
                f"q_layernorm; an activation with parameters inside a split MLP). Add it to the plan as 'heads' "
                f"(replicated weights applied to this rank's heads or features: gradients summed over the group), "
                f"'split_norm' (a norm over the whole width of a colwise output), 'head_rows' (one row per head), or "
                f"under sequence parallel 'sequence'; or leave the projections around it whole")

    def _compare(self, chunk: list[layout.Placement]) -> list[str]:
        device = comm_device(self._comm)
        grads = [local(pl.param.grad) if pl.param.grad is not None else None for pl in chunk]
        values = [torch.zeros(local(pl.param).numel(), dtype=torch.float32, device=device) if g is None
                  else g.detach().reshape(-1).to(device=device, dtype=torch.float32) for pl, g in zip(chunk, grads)]
        flags = torch.tensor([g is not None for g in grads], dtype=torch.float32, device=device)
        high, low = _group_max_min(torch.cat([*values, flags]), self._comm)
        n = high.numel() - len(chunk)
        has_any, has_all = high[n:].cpu(), low[n:].cpu()
        problems, start = [], 0
        for i, (pl, v) in enumerate(zip(chunk, values)):
            spread, scale = _spread_and_scale(high[start:start + v.numel()], low[start:start + v.numel()])
            start += v.numel()
            if has_any[i] != has_all[i]:
                self._done.add(pl.name)
                problems.append(f"{pl.name} has a gradient on some ranks only")
                continue
            if not has_any[i]:
                continue  # no gradient anywhere yet (frozen, or unused this step): a later step compares it
            if not math.isfinite(spread):
                continue  # an overflow step (GradScaler): a later, finite step compares it
            self._done.add(pl.name)
            if spread > _tolerance(pl.param.grad.dtype) * scale:
                problems.append(f"{pl.name} {tuple(pl.shape)} (max spread {spread:.3g} of max |grad| {scale:.3g})")
        return problems


def stages_check(stages: Iterable[nn.Module], comm: Communicator) -> ReplicatedGradCheck | None:
    """One check over the pipeline stages this rank holds (`sw.parallelize`), each stage's record declaring it: the
    optimizer guard runs it once per step, over the union of the stages' parameters. None when `comm` is one rank."""
    stages = list(stages)
    return None if comm.size == 1 else ReplicatedGradCheck(
        lambda: {name: pl for stage in stages for name, pl in layout.placements(stage).items()}, comm)


def check_partial(grad: torch.Tensor, comm: Communicator, where: str) -> bool:
    """The other direction, at the first backward of a parameter whose gradient a hook sums over `comm` (a "heads" or
    "sequence" region, sequence_parallel.py): its contributions must differ across the ranks, each a part. Equal
    ones mean the module runs on the whole, replicated activations (a replicated LayerNorm declared "heads"), and the
    sum would count its gradient tp times, silently: a ValueError naming `where`. One MAX all-reduce of ``[g, -g]``.
    Returns whether the contribution was compared (False while it is zero or non-finite everywhere: the next one is)."""
    flat = local(grad).detach().reshape(-1).float()  # an expert-parallel piece: this rank's experts
    spread, scale = _spread_and_scale(*_group_max_min(flat, comm))
    if scale == 0.0 or not math.isfinite(spread):
        return False
    if spread <= _tolerance(grad.dtype) * scale:
        raise ValueError(f"tensor parallel: {where or 'a parameter'} is declared a region of this rank's part of "
                         f"the activations ('heads', or 'sequence' under sequence parallel), so its gradient is "
                         f"summed over the {comm.size} ranks of the group, but every rank computed the same "
                         f"gradient: it runs on the whole, replicated activations, and the sum would count it "
                         f"{comm.size} times. Leave it out of the plan (a replicated module needs no style)")
    return True
