"""A check of a model `sw.parallelize` split into pipeline stages: how its ranks train and what they report.

A pipeline computes its loss inside the schedule (each microbatch's forward, then its backward, interleaved with the
other stages'), so a rank cannot run `loss_fn(model, batch)` then `loss.backward()`: it runs
`model.step(inputs, targets)`, which returns the loss of its data-parallel rows with every gradient of its stages
in place. The batch says what the inputs and targets are:

* a HuggingFace batch ``{"input_ids": ..., "labels": ...}`` (with ``position_ids`` for packed rows, and then
  ``use_cache=False``, or a 2-D ``attention_mask`` for padded ones): ``step(inputs, labels)``, the stages computing
  HuggingFace's causal-LM loss over the global batch (labels shifted inside, -100 ignored), what ``model(**batch).loss``
  is in one process;
* ``(x, y)`` for a model whose ``forward(x, y)`` returns the mean loss of its tokens (shardwise's GPT): ``step(x, y)``.

A MoE balance loss is computed per microbatch under a pipeline (balance_loss.py): the one process then accumulates
over the same global microbatches (`accumulating_step`: microbatch j is the j-th microbatch of every data-parallel
rank's rows, each loss / n_microbatches), which is what the ranks compute. A HuggingFace MoE's router loss is too
(models/hf_router_loss.py), beside a causal-LM loss that stays the whole batch's (`router_loss_step`).

A `loss_fn` of the user's is refused: the stages' loss is the model's own (sw.parallelize's `loss_fn`, which a
callable strategy may pass). Each stage holds some of the parameters and buffers, so the names a rank records
(`whole_names`) are every stage's, exchanged over the pipeline groups, as `full_state_dict` exchanges the tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..comm.objects import all_gather_json
from ..whole.state_dict import partition_groups
from .inputs import batch_rows

__all__ = ["BATCH_FORMS", "accumulating_step", "check_pipeline_batch", "pipeline_step", "refuse_pipeline_loss_fn",
           "router_loss_step", "whole_names"]

BATCH_FORMS = ("a HuggingFace dict with 'input_ids' and 'labels' (and 'position_ids' or 'attention_mask'), or "
               "(x, y) for a model whose forward(x, y) returns the mean loss of its tokens")


def refuse_pipeline_loss_fn(loss_fn: object) -> None:
    if loss_fn is not None:
        raise ValueError(f"check: loss_fn cannot be combined with pp > 1: pipeline stages compute the model's own loss "
                         f"inside the schedule (sw.parallelize's loss_fn; pass it through a callable strategy); pass "
                         f"loss_fn=None and a batch that is {BATCH_FORMS}")


def _inputs_and_targets(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, dict) and "input_ids" in batch and "labels" in batch:
        # use_cache=False (what one process needs to keep packed documents apart): a pipeline never caches
        inputs = {k: v for k, v in batch.items() if k != "labels" and not (k == "use_cache" and v is False)}
        return (inputs["input_ids"] if len(inputs) == 1 else inputs), batch["labels"]
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ValueError(f"check: under a pipeline the batch must be {BATCH_FORMS}; got "
                     f"{type(batch).__name__}" + (f" with keys {sorted(batch)}" if isinstance(batch, dict) else ""))


def check_pipeline_batch(batch: Any) -> None:
    """ValueError unless `batch` has a form `pipeline_step` takes (before any rank starts)."""
    _inputs_and_targets(batch)


def pipeline_step(model: nn.Module, batch: Any, accumulate: int = 1) -> torch.Tensor:
    """One training step of a HybridModel on this rank's rows: the loss, with every gradient of its stages set
    (added to what earlier steps left, each microbatch's loss / `accumulate` before backward)."""
    inputs, targets = _inputs_and_targets(batch)
    return model.step(inputs, targets, loss_scale=1.0 / accumulate)


def _take_rows(b: Any, rows: torch.Tensor) -> Any:
    if isinstance(b, torch.Tensor):
        return b[rows.to(b.device)] if b.dim() else b
    if isinstance(b, (tuple, list)):
        return type(b)(_take_rows(x, rows) for x in b)
    if isinstance(b, dict):
        return {k: _take_rows(v, rows) for k, v in b.items()}
    return b


def _global_microbatches(batch: Any, dp: int, microbatches: int) -> list[torch.Tensor]:
    """The rows of each global microbatch j of `batch`: the j-th of `microbatches` microbatches of each of the `dp`
    data-parallel ranks' equal shares of the rows."""
    n = batch_rows(batch)[0]
    if n % (dp * microbatches):
        raise ValueError(f"check: a batch of {n} rows does not split into {dp} data-parallel ranks x "
                         f"{microbatches} microbatches")
    per_rank, size = n // dp, n // (dp * microbatches)
    return [torch.cat([torch.arange(d * per_rank + j * size, d * per_rank + (j + 1) * size) for d in range(dp)])
            for j in range(microbatches)]


def accumulating_step(forward_backward: Callable[[nn.Module, Any, int], torch.Tensor], dp: int,
                      microbatches: int) -> Callable[[nn.Module, Any, int], torch.Tensor]:
    """One process's step over the global microbatches of a pipeline with `dp` data-parallel ranks and
    `microbatches` microbatches each: `forward_backward(model, rows, k x microbatches)` on each (each loss divided by
    both), returning their mean loss."""
    def step(model: nn.Module, batch: Any, accumulate: int) -> torch.Tensor:
        losses = [forward_backward(model, _take_rows(batch, rows), accumulate * microbatches).detach()
                  for rows in _global_microbatches(batch, dp, microbatches)]
        return torch.stack(losses).mean()

    return step


def router_loss_step(forward_done: Callable[[], None], dp: int,
                     microbatches: int) -> Callable[[nn.Module, Any, int], torch.Tensor]:
    """One process's step of a HuggingFace MoE with a router loss over the global microbatches of a pipeline, as its
    stages compute it (models/hf_router_loss.py): each microbatch's causal-LM loss summed over its labels and divided
    by the whole batch's label count (transformers' ``num_items_in_batch``), plus ``router_aux_loss_coef x`` its own
    router loss / `microbatches`, each backward / k; returns their sum. `forward_done` runs after the first forward."""
    def step(model: nn.Module, batch: Any, accumulate: int) -> torch.Tensor:
        inputs, labels = {k: v for k, v in batch.items() if k != "labels"}, batch["labels"]
        items = int((labels[..., 1:] != -100).sum())  # the labels HuggingFace's shifted loss counts
        coef, vocab = model.config.router_aux_loss_coef, model.config.vocab_size
        total = torch.zeros((), dtype=torch.float64)
        for rows in _global_microbatches(batch, dp, microbatches):
            out = model(**_take_rows(inputs, rows))
            forward_done()
            loss = model.loss_function(out.logits, _take_rows(labels, rows), vocab_size=vocab,
                                       num_items_in_batch=items) + coef * out.aux_loss / microbatches
            (loss / accumulate if accumulate > 1 else loss).backward()
            total = total + loss.detach().to(total.dtype).cpu()
        return total

    return step


def whole_names(model: nn.Module, names: list[Any]) -> list[Any]:
    """`names` (JSON values: this rank's parameter or buffer names) merged with every other pipeline stage's, in
    stage order, each once. Collective over the model's pipeline groups."""
    merged = list(names)
    for group in partition_groups(model):
        stages, merged, seen = all_gather_json(group, merged), [], set()
        for stage in stages:
            for name in stage:
                if str(name) not in seen:
                    seen.add(str(name))
                    merged.append(name)
    return merged
