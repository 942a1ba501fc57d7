"""The two runs a check compares: one process on the global batch, and the strategy on N ranks.

Both run the same loop for `steps` steps and record, at every step, what the report compares:

    loss = loss_fn(model, batch)        forward   the loss (ranks: the average over the data-parallel group)
    loss.backward()                     gradient  every parameter's dense gradient, or None, by original name
    (with accumulate=k: the two lines k times, on k batches, each loss / k; the loss is their mean)
    clip_grad_norm_(model, max_norm)    clip      the total norm before clipping (ranks: sw.clip_grad_norm_)
    opt.step(); opt.zero_grad()         update    every dense parameter and persistent buffer after the step

A model `sw.parallelize` split into pipeline stages runs forward and backward in one call instead, `model.step(inputs,
targets)` (pipelines.py), and its stages exchange what they hold. The ranks gather what they hold to dense tensors
(collectives on every rank); rank 0 keeps the record and returns it, so the comparison happens once, in the caller's
process, after both runs. That costs host memory of about 2 x steps x (the model's parameters + gradients), plus every
module's output of the first forward in float64 (forward_outputs.py): the check is for small copies of a model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .. import layout
from ..comm.base import Communicator, ReduceOp
from ..placement import comm_device
from ..whole import clip_grad_norm_, full_state_dict
from .forward_outputs import OutputRecorder
from .grads import data_parallel_group, full_gradients
from .inputs import build_seeded, compute_loss, describe_optimizer, make_optimizer, slice_batch
from ..balance_loss import balance_layers
from ..models.hf_router_loss import router_loss_coef
from .pipelines import accumulating_step, pipeline_step, refuse_pipeline_loss_fn, router_loss_step, whole_names
from .sequences import chunked_loss
from .spec import Spec

__all__ = ["Job", "StepRecord", "Trace", "reference_trace", "rank_trace"]


@dataclasses.dataclass(frozen=True)
class Job:
    """Everything a rank needs (it pickles to gloo processes)."""

    build_model: Callable[[], nn.Module]
    batches: list[Any]
    spec: Spec
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None
    optimizer: Callable[[Any], torch.optim.Optimizer] | None
    max_norm: float | None
    seed: int
    device: torch.device | None = None  # None: cpu
    accumulate: int = 1  # batches (backward passes, or pipeline steps) per optimizer step
    microbatches: tuple[int, int] | None = None  # (dp, n): a pipeline's; one process then accumulates a MoE's


@dataclasses.dataclass
class StepRecord:
    loss: float
    grads: dict[str, torch.Tensor | None]
    split_grads: tuple[str, ...]
    norm: float | None
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]


@dataclasses.dataclass
class Trace:
    """One run: its steps, the parameters' canonical names (model order) with their aliases, the data-parallel size,
    the optimizer it built, and facts for the diagnoses: BatchNorm modules in training mode that are not
    SyncBatchNorm, Dropout modules with p > 0 in training mode (module names)."""

    steps: list[StepRecord]
    aliases: dict[str, tuple[str, ...]]
    dp: int
    optimizer: str
    batchnorm: tuple[str, ...] = ()
    dropout: tuple[str, ...] = ()
    outputs: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # first forward (forward_outputs.py)
    drew: tuple[str, ...] = ()  # one process: modules that drew random numbers in the first forward
    kinds: dict[str, str] = dataclasses.field(default_factory=dict)  # module name -> class name
    dp_index: int = 0  # this rank's data-parallel index: which rows of the batch its outputs hold


def _facts(model: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    batchnorm = tuple(n for n, m in model.named_modules() if isinstance(m, _BatchNorm) and m.training
                      and "SyncBatchNorm" not in type(m).__name__)
    dropout = tuple(n for n, m in model.named_modules()
                    if isinstance(m, nn.modules.dropout._DropoutNd) and m.training and m.p > 0)
    return batchnorm, dropout


def _whole_batches(model: nn.Module, job: Job) -> bool:
    """Whether one process trains on each whole batch: unless the strategy is a pipeline (job.microbatches) and the
    model has a MoE balance loss, which the pipeline computes per microbatch (balance_loss.py, hf_router_loss.py)."""
    return job.microbatches is None or not (balance_layers(model) or router_loss_coef(model) > 0)


def _hybrid(model: nn.Module) -> Any:
    """The HybridModel `sw.parallelize` returned (a mesh with pp > 1, or a callable strategy), else None; a pipeline
    built by hand (`sw.pipeline.Pipeline`) is refused: the check cannot tell its inputs from its targets."""
    from ..hybrid import HybridModel

    if isinstance(model, HybridModel):
        return model
    if layout.is_partitioned(model) or layout.is_wrapped(model, "pipeline"):
        raise ValueError("check: the strategy built a pipeline by hand; check trains pipelines that sw.parallelize "
                         "builds (a mesh dict with 'pp', or a callable strategy returning sw.parallelize(...))")
    return None


def _forward_backward(loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None,
                      recorder: OutputRecorder | None) -> Callable[[nn.Module, Any, int], torch.Tensor]:
    def run(model: nn.Module, batch: Any, accumulate: int) -> torch.Tensor:
        loss = compute_loss(loss_fn, model, batch)
        if recorder is not None:
            recorder.remove()
        (loss / accumulate if accumulate > 1 else loss).backward()
        return loss

    return run


def _train(model: nn.Module, job: Job, slicer: Callable[[Any], Any], average: Callable[[torch.Tensor], torch.Tensor],
           clip: Callable[[], torch.Tensor], keep: bool, pipeline: bool = False,
           watch_draws: bool = False) -> tuple[list[StepRecord], str, OutputRecorder | None]:
    """The loop both runs share (see the module docstring); records only when `keep`, with every module's output
    of the first forward (of this rank's stages, for a pipeline) and, with `watch_draws` (one process), the modules
    that drew random numbers there (forward_outputs.py)."""
    opt = make_optimizer(job.optimizer, model)
    names = [pl.name for pl in layout.placements(model).values()]
    buffers = list(layout.buffers(model))
    if pipeline:  # a rank holds its stages' names: the record keeps the whole model's
        names, buffers = whole_names(model, names), whole_names(model, buffers)
    records = []
    recorder = OutputRecorder(model, watch_draws) if keep else None
    train_step = pipeline_step if pipeline else _forward_backward(job.loss_fn, recorder)
    if not pipeline and not _whole_batches(model, job):  # a MoE balance loss per pipeline microbatch
        if router_loss_coef(model) > 0:
            train_step = router_loss_step(recorder.remove if recorder is not None else lambda: None,
                                          *job.microbatches)
        else:
            train_step = accumulating_step(train_step, *job.microbatches)
    k = job.accumulate
    for start in range(0, len(job.batches), k):  # one optimizer step per k batches, each loss / k
        losses = [train_step(model, slicer(batch), k).detach().to(torch.float64)
                  for batch in job.batches[start:start + k]]
        if recorder is not None:
            recorder.remove()
        value = float(average(torch.stack(losses).mean().reshape(1))[0])
        grads, split = full_gradients(model)
        norm = float(clip()) if job.max_norm is not None else None
        opt.step()
        state = full_state_dict(model)
        opt.zero_grad()
        if keep:
            records.append(StepRecord(value, grads, split, norm, {n: state[n] for n in names},
                                      {n: state[n] for n in buffers if n in state}))
    return records, describe_optimizer(opt), recorder


def reference_trace(job: Job) -> Trace:
    """One process, the whole global batch, torch's own clipping."""
    model = build_seeded(job.build_model, job.seed)
    if job.device is not None:
        model = model.to(job.device)
    aliases = {pl.name: pl.names for pl in layout.placements(model).values()}

    def clip() -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), job.max_norm)

    steps, opt, recorder = _train(model, job, lambda b: slice_batch(b, 0, 1, job.device), lambda t: t, clip, True,
                                  watch_draws=True)
    assert recorder is not None
    return Trace(steps, aliases, 1, opt, *_facts(model), outputs=recorder.outputs, kinds=recorder.kinds,
                 drew=tuple(recorder.drew))


def rank_trace(comm: Communicator, job: Job) -> Trace | None:
    """One rank of the strategy's run (the body `sw.launch` runs); rank 0 returns the Trace, the others None."""
    mesh = job.spec.mesh(comm) if job.spec.kind == "mesh" else None
    model = job.spec.wrap(build_seeded(job.build_model, job.seed), comm, mesh)
    hybrid = _hybrid(model)
    dp = data_parallel_group(model)  # the ranks averaging the gradients (dp x cp under context parallel)
    index, parts = (dp.rank, dp.size) if dp is not None else (0, 1)
    if hybrid is not None:  # its step splits sequences over cp itself and returns their mean: average over dp
        refuse_pipeline_loss_fn(job.loss_fn)
        if hybrid.balance_loss_per_microbatch and job.microbatches != (hybrid.mesh.dp.size,
                                                                       hybrid.pipe.n_microbatches):
            raise ValueError("check: the model's MoE balance loss is computed per microbatch under this pipeline "
                             "(docs/hybrid.md), and the check's one process knows the microbatches only of a mesh "
                             "dict ({'pp': ..., 'n_microbatches': ...}); check it that way, or with "
                             "moe_aux_loss_coef=0 (router_aux_loss_coef=0 for a HuggingFace MoE)")
        dp = hybrid.mesh.dp
        index, parts = dp.rank, dp.size
    elif job.spec.cp > 1:  # the cp ranks of a data-parallel rank share its rows and split their sequences
        index, parts = mesh.coords.dp, mesh.sizes["dp"]
        job = dataclasses.replace(job, loss_fn=chunked_loss(mesh.dp, mesh.cp))
    device = comm_device(comm)

    def average(value: torch.Tensor) -> torch.Tensor:
        if dp is None or dp.size == 1:
            return value
        value = value.to(comm_device(dp))
        dp.all_reduce(value, ReduceOp.AVG)
        return value.cpu()

    def clip() -> torch.Tensor:
        return clip_grad_norm_(model, job.max_norm)

    steps, opt, recorder = _train(model, job, lambda b: slice_batch(b, index, parts, device), average, clip,
                                  comm.rank == 0, pipeline=hybrid is not None)
    aliases = [[pl.name, list(pl.names)] for pl in layout.placements(model).values()]
    if hybrid is not None:  # collective: before the ranks that keep no record leave
        aliases = whole_names(model, aliases)
    if recorder is None:
        return None
    return Trace(steps, {name: tuple(names) for name, names in aliases}, parts, opt, *_facts(model),
                 outputs=recorder.outputs, kinds=recorder.kinds, dp_index=index)
