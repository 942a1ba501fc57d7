"""HuggingFace causal LMs under `sw.parallelize`: their pipeline layers and the loss that makes each rank's share of
the global batch train as one process on the whole batch, with context parallel and Mixtral's router loss.

`hf_pipeline(model, loss_fn, dp=..., cp=..., batch_group=...)` returns the stages (hf_stages.py), the loss over the
last stage's output and whether the targets are cut like the inputs. Two things HuggingFace's own forward does over
the whole sequence and batch have to be rebuilt for a rank that sees only part of them:

* **The causal-LM loss over the global batch.** ``model(x, labels=y).loss`` shifts the labels left by one and
  averages the cross entropy over every label that is not -100. A rank holds some rows (data parallel), a
  microbatch of them at a time (pipeline), and under context parallel chunks of each sequence (zigzag: chunks r and
  2cp-1-r). Means of those parts, averaged, weigh unequal label counts equally (padded rows, a masked prompt; and the
  sequence's last token predicts nothing and sits on one cp rank); shifting inside a chunk would pair its last token
  with the wrong label. `GlobalCausalLMLoss` takes the *whole* labels (the step does not cut them over cp), shifts
  them over the whole sequence, keeps this rank's positions, and divides the sum of this rank's cross entropies by
  the step's label count over every data-parallel rank (counted once per step, `begin_step`), times the number of
  parts the pipeline and the gradient average divide by: their means make HuggingFace's mean over the global batch.
* **Mixtral's load-balancing loss** (``output_router_logits=True``, ``router_aux_loss_coef > 0``): HuggingFace adds
  ``coef x aux`` computed from every MoE layer's router logits in the model's forward, which the stages bypass.
  `RouterLoss` records those logits with forward hooks on the routers and adds ``coef x aux`` to the loss, with aux
  over the ranks splitting the batch (``experts.hf_aux.global_balance_loss``: counts, rows and probability sums
  summed over dp x cp, the gradient summed back), so it is the global batch's. It is a product of two batch means,
  not a mean over microbatches: `sw.parallelize` allows it with pp = 1 and one microbatch (hybrid_plan.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.base import Communicator
from . import hf_stages

__all__ = ["BUILDERS", "GlobalCausalLMLoss", "RouterLoss", "hf_pipeline", "router_loss_coef"]

#: HuggingFace ``config.model_type`` -> the function building its pipeline layers (hf_stages.py).
BUILDERS: dict[str, Callable[..., list[nn.Module]]] = {
    "llama": hf_stages.llama_pipeline_layers, "mistral": hf_stages.llama_pipeline_layers,
    "qwen2": hf_stages.llama_pipeline_layers, "qwen3": hf_stages.llama_pipeline_layers,
    "gemma": hf_stages.llama_pipeline_layers, "mixtral": hf_stages.llama_pipeline_layers,
    "qwen2_moe": hf_stages.llama_pipeline_layers, "qwen3_moe": hf_stages.llama_pipeline_layers,
    "gpt_oss": hf_stages.llama_pipeline_layers,
    "gpt2": hf_stages.gpt2_pipeline_layers,
}


class GlobalCausalLMLoss:
    """HuggingFace's causal-LM loss of the step's global batch, as each microbatch's part of it on this rank
    (module docstring): ``loss(logits, labels)`` with logits (b, L, V) of this rank's tokens (all of them, or under
    context parallel the chunks `split_sequence` gave it, L = T / cp) and the microbatch's whole labels (b, T).

    `begin_step(labels, n_microbatches)`, which `HybridModel.step` calls with this rank's whole labels before the
    schedule runs, counts the labels that are not -100 (shifted left by one, as HuggingFace shifts them) and sums
    the count over the data-parallel ranks: N. A microbatch's loss is then its cross-entropy sum times
    dp x cp x n_microbatches / N, so the pipeline's mean over microbatches and the data-parallel average over dp x cp
    make sum(every cross-entropy) / N, one process's loss, whatever the rows' padding."""

    def __init__(self, dp: Communicator, cp: Communicator, zigzag: bool = True) -> None:
        from ..context_parallel.split import SequenceSplit

        self.dp, self.cp = dp, cp
        self.split = SequenceSplit(cp.size, zigzag) if cp.size > 1 else None
        self.factor: torch.Tensor | None = None

    def begin_step(self, labels: Any, n_microbatches: int) -> None:
        if not isinstance(labels, torch.Tensor) or labels.dim() != 2:
            raise ValueError(f"parallelize: HuggingFace's causal-LM loss takes step(input_ids, labels) with labels "
                             f"a (batch, sequence) tensor, got {type(labels).__name__}"
                             f"{tuple(labels.shape) if isinstance(labels, torch.Tensor) else ''}")
        count = (hf_stages.shifted_labels(labels) != hf_stages.IGNORE_INDEX).sum().to(torch.float64).reshape(1)
        count = count.to(self.dp.device)
        if self.dp.size > 1:
            self.dp.all_reduce(count)
        # No label anywhere: 0 x inf = NaN, HuggingFace's mean over no label.
        self.factor = self.dp.size * self.cp.size * n_microbatches / count

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.factor is None:
            raise RuntimeError("parallelize: the global causal-LM loss was called outside HybridModel.step, which "
                               "counts the step's labels first")
        L, T = logits.shape[-2], labels.shape[-1]
        if logits.dim() != 3 or labels.dim() != 2 or labels.shape[0] != logits.shape[0] or T != L * self.cp.size:
            raise ValueError(f"parallelize: labels of shape {tuple(labels.shape)} must be the whole sequences "
                             f"(b, cp x L) of logits {tuple(logits.shape)} (b, L, V), cp={self.cp.size}")
        mine = hf_stages.shifted_labels(labels).to(logits.device)
        if self.split is not None:
            mine = mine.index_select(1, self.split.positions(self.cp.rank, L, logits.device))
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), mine.reshape(-1),
                                ignore_index=hf_stages.IGNORE_INDEX, reduction="sum")
        return total * self.factor.to(device=total.device, dtype=total.dtype).reshape(())


def router_loss_coef(model: nn.Module) -> float:
    """``router_aux_loss_coef`` of a model whose forward adds Mixtral's load-balancing loss (Mixtral, Qwen2/3-MoE:
    experts.hf_kinds.global_aux_model) with output_router_logits on and a coefficient > 0, else 0.0."""
    from ..experts.hf_kinds import global_aux_model

    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False) or not global_aux_model(model):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def _routers(model: nn.Module) -> tuple[list[nn.Module], int]:
    """The modules whose outputs HuggingFace records as ``router_logits`` (the model's ``_can_record_outputs``:
    MixtralTopKRouter, Qwen3MoeTopKRouter, ...) and the index of the logits in their output."""
    recorder = getattr(type(model), "_can_record_outputs", None) or {}
    recorder = recorder.get("router_logits")
    target = getattr(recorder, "target_class", None)
    if target is None:
        raise ValueError(f"parallelize: {type(model).__name__} does not say which modules' outputs are its router "
                         f"logits (_can_record_outputs['router_logits']); router_aux_loss_coef=0 trains without the "
                         f"load-balancing loss")
    return [m for m in model.modules() if isinstance(m, target)], int(getattr(recorder, "index", 0) or 0)


class RouterLoss:
    """Records the router logits of every MoE layer (Mixtral, Qwen2/3-MoE) in the stages' forward and adds HF's
    ``router_aux_loss_coef x load_balancing_loss`` of the global batch to `loss_fn` (module docstring).

    The record restarts at each forward of the first layer (the embedding), so logits recomputed in backward by
    activation checkpointing never mix with the next step's; the loss takes exactly one set per forward."""

    def __init__(self, model: nn.Module, first: nn.Module, batch_group: Communicator) -> None:
        config = model.config
        self.coef = router_loss_coef(model)
        self.experts, self.top_k = model.num_experts, model.num_experts_per_tok
        self.batch_group = batch_group
        self.logits: list[torch.Tensor] = []
        routers, self.index = _routers(model)
        run = {id(m) for layer in list(model.model.layers)[: config.num_hidden_layers] for m in layer.modules()}
        routers = [r for r in routers if id(r) in run]  # the MoE layers HuggingFace's forward runs (dense: none)
        if not routers:
            raise ValueError(f"parallelize: found no router module in {type(model).__name__}'s decoder layers; "
                             f"router_aux_loss_coef=0 trains without the load-balancing loss")
        self.n_routers = len(routers)
        first.register_forward_pre_hook(lambda module, args: self.logits.clear())
        for router in routers:
            router.register_forward_hook(self._record)

    def _record(self, module: nn.Module, args: Any, output: Any) -> None:
        self.logits.append(output[self.index] if isinstance(output, tuple) else output)

    def wrap(self, loss_fn: Callable[[Any, Any], torch.Tensor]) -> Callable[[Any, Any], torch.Tensor]:
        from ..experts.hf_aux import global_balance_loss

        def loss(output: Any, target: Any) -> torch.Tensor:
            logits, self.logits = self.logits, []
            if len(logits) != self.n_routers:
                raise RuntimeError(f"parallelize: {len(logits)} router outputs recorded for {self.n_routers} MoE "
                                   f"layers in this forward; the load-balancing loss needs the whole batch in one "
                                   f"forward (pp=1, n_microbatches=1)")
            aux = global_balance_loss(tuple(logits), self.experts, self.top_k, None, self.batch_group)
            return loss_fn(output, target) + self.coef * aux.to(output.device)

        if hasattr(loss_fn, "begin_step"):
            loss.begin_step = loss_fn.begin_step  # type: ignore[attr-defined]
        return loss


def hf_pipeline(model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor] | None, *, dp: Communicator,
                cp: Communicator, batch_group: Communicator) -> tuple[list[nn.Module], Callable[[Any, Any],
                                                                                              torch.Tensor], bool]:
    """(pipeline layers, loss, whether `step` cuts the targets like the inputs) of a known HuggingFace decoder.

    dp / cp: the data- and context-parallel groups (size 1: none). batch_group: the ranks splitting the global batch
    (dp x cp). loss_fn None (or hf_stages.causal_lm_loss) is HuggingFace's loss on ``step(input_ids, labels)`` over
    the global batch (`GlobalCausalLMLoss`; the labels stay whole under context parallel). A loss_fn of the user's
    gets this rank's chunks of the output and of the targets, cut alike. Mixtral's router loss is added when its
    config asks for it.
    """
    layers = BUILDERS[model.config.model_type](model, cp=cp)
    default = loss_fn is None or loss_fn is hf_stages.causal_lm_loss
    split_targets = cp.size == 1 or not default
    loss = GlobalCausalLMLoss(dp, cp) if default else loss_fn
    if router_loss_coef(model) > 0:
        loss = RouterLoss(model, layers[0], batch_group).wrap(loss)
    return layers, loss, split_targets
