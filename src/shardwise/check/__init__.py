"""`sw.check`: run YOUR model under a strategy on CPU ranks for a few steps against one process, before a GPU hour.

    report = sw.check(build_model, batch, strategy="zero3", world_size=2, steps=3)
    print(report)                 # header, first mismatch, notes, losses and norms per step, one row per tensor
    report.ok                     # every value within rtol / atol
    report.first_mismatch         # None, or (step, phase, name, index, got, want) of the first difference

At every step the two runs are compared in four phases, in order: forward (the loss), gradient (every parameter's dense
gradient by original name, None included), clip (the total norm `sw.clip_grad_norm_` returns against torch's) and update
(every dense parameter and persistent buffer after `optimizer.step()`). Files: spec.py parses the strategy, inputs.py
the model, batch, loss and optimizer, run.py runs the two sides, grads.py gathers gradients, compare.py compares them,
report.py is the CheckReport; pipelines.py trains pipeline stages (`model.step`). The command line is `shardwise check`
(shardwise_cli).
"""

from __future__ import annotations

import collections
import threading

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..launch import LaunchError, launch
from .compare import compare
from .inputs import check_divides, check_picklable, resolve_batches
from .pipelines import check_pipeline_batch, refuse_pipeline_loss_fn
from .report import PHASES, CheckReport, Mismatch, TensorRow
from .run import Job, rank_trace, reference_trace
from .sequences import packed_rows_note, refuse_loss_fn
from .spec import DP_STRATEGIES, MESH_KEYS, STRATEGIES, TP_PLANS, parse_strategy

__all__ = ["check", "CheckReport", "Mismatch", "TensorRow", "PHASES", "STRATEGIES", "DP_STRATEGIES", "MESH_KEYS",
           "TP_PLANS", "BACKENDS"]

_REFERENCES_LOCK = threading.Lock()

#: How the ranks run: threads of this process, or gloo processes on 127.0.0.1.
BACKENDS = ("thread", "gloo")


def _number(name: str, value: object, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 if positive else value >= 0):
        raise ValueError(f"check: {name}={value!r} must be a {'positive' if positive else 'non-negative'} number")
    return float(value)


def check(
    build_model: Callable[[], nn.Module],
    batch: Any,
    *,
    strategy: str | dict[str, Any] | Callable[[nn.Module, Any], nn.Module] = "zero3",
    world_size: int = 2,
    steps: int = 3,
    accumulate: int = 1,
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    max_norm: float | None = 1.0,
    seed: int = 0,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    backend: str = "thread",
    timeout: float = 120.0,
    device: str | torch.device | None = None,
) -> CheckReport:
    """Train `build_model()` for `steps` steps under `strategy` on `world_size` ranks and in one process on the same
    global batches; return the CheckReport of their differences (see the module docstring).

    build_model: a zero-argument callable returning a fresh nn.Module; called once for one process and once per
        rank, each under `torch.manual_seed(seed)` and one process-wide lock, so every copy starts identical.
    batch: the global batch (a tensor, a tuple/list or dict of tensors) or `batch(i)` returning the i-th one (i in
        range(steps x accumulate)). Data-parallel
        rank d of D takes rows [d*b, (d+1)*b) of every tensor (b = rows / D, which must divide); tensor-parallel
        ranks of one data-parallel group take the same rows; one process takes all of them. With a function, the
        one-process run is computed once and reused by later checks of the same functions and options in this
        process (checking one model under several strategies).
    strategy: "none" (one rank), "ddp", "ddp:find_unused", "zero1", "zero2", "zero3", "fsdp" (= "fsdp:full_shard"),
        "fsdp:shard_grad_op", "fsdp:no_shard", "fsdp:hybrid_shard" (shards over half the ranks: world_size even and
        >= 4), "distribute" (sw.distribute's choice), "tp" / "tp:<plan>" (tensor parallel over every rank); a dict
        for a mesh, {"tp": 2, "tp_plan": "llama", "dp_strategy": "zero3", "sequence_parallel": False}: tensor
        parallel over mesh.tp then the data-parallel strategy over mesh.dp; "ep" splits a MoE model's experts over ep
        data-parallel ranks; "cp" (with "cp_method": "ring" / "ulysses") splits every sequence over cp ranks
        (sequences.py computes their loss); "pp" (with "pp_schedule", "n_microbatches", "virtual_stages",
        "activation_checkpointing") splits the model into pipeline stages, every axis then applied by
        `sw.parallelize`, the ranks training with
        `model.step(inputs, targets)` (pipelines.py: the batch is a HuggingFace {'input_ids', 'labels'} dict or
        (x, y), and loss_fn stays None); or a callable (model, comm) -> wrapped model (`sw.parallelize`'s result
        included).
    accumulate: batches per optimizer step (gradient accumulation, as a script with gradient_accumulation_steps
        runs it): k forward and backward passes (pipeline steps), each loss divided by k, then clip and step; the
        forward loss compared is the mean of the k.
    optimizer: params -> torch.optim.Optimizer, built over `model.parameters()` after wrapping; default
        AdamW(lr=1e-3, weight_decay=0.1, eps=1e-5) (inputs.default_optimizer says why eps is 1e-5).
    loss_fn: loss_fn(model, batch) -> scalar tensor; default: the model's output on the batch (`model(*batch)`,
        `model(**batch)` or `model(batch)`) if it is a scalar, else its `.loss`. The forward comparison averages the
        data-parallel ranks' losses, which equals one process's loss when the loss is a mean over examples of equal
        weight.
    max_norm: clip every step (`sw.clip_grad_norm_`, and torch's in one process); None: no clipping.
    rtol, atol: an element differs when |got - want| > atol + rtol x |want|.
    backend: "thread" (ranks are threads of this process) or "gloo" (processes: build_model, loss_fn, optimizer and
        a callable strategy must then be top-level functions of importable modules).
    timeout: seconds any collective may wait before the run fails.
    device: where both runs compute (thread ranks only): None or "cpu" (default), or "cuda" / "cuda:N": the one
        process and every thread rank on that GPU (the ranks share it; `comm.device` is it), the strategy's CUDA
        paths checked on one device.
    Raises ValueError, naming the value and what is allowed, for bad arguments (before any rank starts where it
    can), and a LaunchError naming the rank when a rank fails otherwise.
    """
    if not callable(build_model) or isinstance(build_model, nn.Module):
        got = f"a {type(build_model).__name__} module" if isinstance(build_model, nn.Module) else \
            repr(build_model)[:80]
        raise ValueError(f"check: build_model must be a zero-argument callable returning a fresh torch.nn.Module "
                         f"(e.g. lambda: MyModel(config)), got {got}; a module object cannot give each rank and the "
                         f"reference their own identical copy")
    for name, value in (("steps", steps), ("accumulate", accumulate)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"check: {name}={value!r} must be a positive int")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"check: seed={seed!r} must be an int")
    for name, value in (("loss_fn", loss_fn), ("optimizer", optimizer)):
        if value is not None and not callable(value):
            raise ValueError(f"check: {name}={value!r} must be a callable or None")
    if max_norm is not None:
        max_norm = _number("max_norm", max_norm, positive=True)
    rtol, atol = _number("rtol", rtol), _number("atol", atol)
    timeout = _number("timeout", timeout, positive=True)
    if backend not in BACKENDS:
        raise ValueError(f"check: backend={backend!r} is not supported; allowed {list(BACKENDS)}")
    device = torch.device(device) if device is not None else None
    if device is not None and device.type != "cpu" and backend != "thread":
        raise ValueError(f"check: device={str(device)!r} needs backend='thread' (gloo processes compute on the cpu)")
    spec = parse_strategy(strategy, world_size)
    if spec.pp > 1:
        refuse_pipeline_loss_fn(loss_fn)
    elif spec.cp > 1:
        refuse_loss_fn(loss_fn)
    batches = resolve_batches(batch, steps * accumulate)
    if spec.pp > 1:
        check_pipeline_batch(batches[0])
    if spec.dp is not None:
        check_divides(batches, spec.dp)
    if backend == "gloo":
        check_picklable(build_model=build_model, loss_fn=loss_fn, optimizer=optimizer, strategy=spec.wrapper)
    # A pipeline's microbatches, which a MoE balance loss is computed over (sw.parallelize's default: 2 x pp).
    microbatches = (spec.dp, spec.n_microbatches or 2 * spec.pp) if spec.pp > 1 else None
    job = Job(build_model, batches, spec, loss_fn, optimizer, max_norm, seed, device, accumulate, microbatches)
    reference = _reference(job, batch)
    traces = _launch(job, backend, timeout, device)
    report = compare(reference, traces[0], strategy=spec.label, world_size=spec.world_size, max_norm=max_norm,
                     rtol=rtol, atol=atol, backend=backend, accumulate=accumulate)
    packed = packed_rows_note(batches[0], build_model) if report.first_mismatch is not None else None
    if packed is not None and report.first_mismatch.step == 0 and report.first_mismatch.phase == "forward":
        report.notes.insert(0, packed)
    return report


_REFERENCES: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
_REFERENCES_KEPT = 4


def _reference(job: Job, batch: Any) -> Any:
    """The one-process run, reused when the same functions are checked again under another strategy (the model
    matrix checks each model under a dozen): keyed by the identity of build_model, batch (a function: a tensor may
    change in place between calls), loss_fn and optimizer, and by steps, seed and max_norm; the last few are kept."""
    if not callable(batch):
        return reference_trace(job)
    key = (job.build_model, batch, job.loss_fn, job.optimizer, len(job.batches), job.seed, job.max_norm, job.device,
           job.accumulate, job.microbatches)
    with _REFERENCES_LOCK:
        if key in _REFERENCES:
            _REFERENCES.move_to_end(key)
            return _REFERENCES[key]
    trace = reference_trace(job)
    with _REFERENCES_LOCK:
        _REFERENCES[key] = trace
        while len(_REFERENCES) > _REFERENCES_KEPT:
            _REFERENCES.popitem(last=False)
    return trace


def _launch(job: Job, backend: str, timeout: float, device: torch.device | None) -> list[Any]:
    """The ranks' traces; a ValueError a rank raised (a strategy refusing the model) is raised as itself."""
    try:
        return launch(rank_trace, job.spec.world_size, job, backend=backend, timeout=timeout, device=device)
    except LaunchError as exc:
        cause = exc.__cause__
        if isinstance(cause, ValueError):
            raise cause from None
        if exc.summary.startswith("ValueError: "):
            raise ValueError(exc.summary.removeprefix("ValueError: ")) from exc
        raise
