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
  hf_router_loss.py carries the sums that loss is made of (assignments, tokens and router probabilities per expert,
  padding weighted out) from layer to layer and stage to stage, and the last stage adds ``coef x aux`` of their sums
  over the ranks splitting the batch: the global batch's with one microbatch, each global microbatch's with several.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.base import Communicator
from . import hf_stages
from .hf_alibi_stages import ALIBI_PATHS, alibi_pipeline_layers
from .hf_families import LLAMA_SHAPED, pipeline_kinds
from .hf_gpt2_stages import GPT2_SHAPED, gpt2_pipeline_layers
from .hf_opt_stages import opt_pipeline_layers
from .hf_router_loss import carry_router_statistics, router_loss_coef

__all__ = ["BUILDERS", "GlobalCausalLMLoss", "hf_pipeline", "labels_at_padding", "pipeline_builder",
           "router_loss_coef"]

#: HuggingFace ``config.model_type`` -> the function building its pipeline layers (hf_stages.py).
BUILDERS: dict[str, Callable[..., list[nn.Module]]] = {
    **{model_type: hf_stages.llama_pipeline_layers for model_type in LLAMA_SHAPED},
    **{model_type: gpt2_pipeline_layers for model_type in GPT2_SHAPED},
    "opt": opt_pipeline_layers,
    **{model_type: alibi_pipeline_layers for model_type in ALIBI_PATHS},
}


def pipeline_builder(model: nn.Module) -> Callable[..., list[nn.Module]] | None:
    """The function building `model`'s pipeline layers: its type's in `BUILDERS`, Llama's for a family whose
    forwards are those of listed ones (hf_families.pipeline_kinds), else None."""
    builder = BUILDERS.get(getattr(getattr(model, "config", None), "model_type", None))
    if builder is None and pipeline_kinds(model) is not None:
        builder = hf_stages.llama_pipeline_layers
    return builder


class GlobalCausalLMLoss:
    """HuggingFace's causal-LM loss of the step's global batch, as each microbatch's part of it on this rank
    (module docstring): ``loss(logits, labels)`` with logits (b, L, V) of this rank's tokens (all of them, or under
    context parallel the chunks `split_sequence` gave it, L = T / cp) and the microbatch's whole labels (b, T).

    `begin_step(labels, n_microbatches)`, which `HybridModel.step` calls with this rank's whole labels before the
    schedule runs, counts the labels that are not -100 (shifted left by one, as HuggingFace shifts them) and sums
    the count over the data-parallel ranks: N. A microbatch's loss is then its cross-entropy sum times
    dp x cp x n_microbatches / N, so the pipeline's mean over microbatches and the data-parallel average over dp x cp
    make sum(every cross-entropy) / N, one process's loss, whatever the rows' padding.

    Given the step's `inputs` too (a dict with ``attention_mask``, or ``(input_ids, position_ids, attention_mask)``),
    it refuses a label predicted at a padding position (`labels_at_padding`), on every data-parallel rank at once."""

    def __init__(self, dp: Communicator, cp: Communicator, zigzag: bool = True) -> None:
        from ..context_parallel.split import SequenceSplit

        self.dp, self.cp = dp, cp
        self.split = SequenceSplit(cp.size, zigzag) if cp.size > 1 else None
        self.factor: torch.Tensor | None = None

    def begin_step(self, labels: Any, n_microbatches: int, inputs: Any = None) -> None:
        if not isinstance(labels, torch.Tensor) or labels.dim() != 2:
            raise ValueError(f"parallelize: HuggingFace's causal-LM loss takes step(input_ids, labels) with labels "
                             f"a (batch, sequence) tensor, got {type(labels).__name__}"
                             f"{tuple(labels.shape) if isinstance(labels, torch.Tensor) else ''}")
        scored = hf_stages.shifted_labels(labels) != hf_stages.IGNORE_INDEX
        stray = labels_at_padding(inputs, scored)
        # (label count, labels at padding): one all-reduce, so that every rank refuses a stray label together
        counts = torch.stack([scored.sum(), stray.sum()]).to(torch.float64).to(self.dp.device)
        if self.dp.size > 1:
            self.dp.all_reduce(counts)
        if counts[1] > 0:
            raise ValueError(_stray_label_message(labels, stray, int(counts[1])))
        # No label anywhere: 0 x inf = NaN, HuggingFace's mean over no label.
        self.factor = self.dp.size * self.cp.size * n_microbatches / counts[:1]

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


def labels_at_padding(inputs: Any, scored: torch.Tensor) -> torch.Tensor:
    """Where a label is scored (`scored`: the labels shifted left by one, as HuggingFace's loss pairs them with the
    logits, are not -100) at a padding position of the step's `inputs` (``attention_mask`` 0), (B, T) bool; all False
    without a mask of that shape.

    Why refused: HuggingFace's loss scores the logits at t against label t + 1, and a padding token's logits are an
    artefact of how the attention treats it (a padding query after left padding sees no key at all: transformers'
    eager attention spreads it over every key, NaN in float64, SDPA gives it zeros; after right padding it sees the
    tokens before it). The stages, and context parallel, let a padding token see itself only (hf_stage_inputs,
    context_parallel/documents.py), so such a label would train on other numbers than one process's, silently."""
    mask = inputs.get("attention_mask") if isinstance(inputs, dict) else \
        inputs[2] if isinstance(inputs, (tuple, list)) and len(inputs) > 2 else None
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(scored.shape):
        return torch.zeros_like(scored)
    return scored & (mask.to(scored.device) == 0)


def _stray_label_message(labels: torch.Tensor, stray: torch.Tensor, total: int) -> str:
    where = stray.nonzero()
    if len(where):
        row, t = (int(i) for i in where[0])
        first = (f"this rank's row {row}: label {int(labels[row, t + 1])} at position {t + 1} would be predicted by "
                 f"the logits at position {t}, a padding token (attention_mask 0)")
    else:
        first = "all on other data-parallel ranks' rows"
    return (f"parallelize: {total} label(s) of the step are predicted at padding positions ({first}). A padding "
            f"token's logits are not one process's here (each sees only itself; transformers' own eager and SDPA "
            f"attention disagree there too): set the labels to -100 on the padding and, after left padding, on each "
            f"row's first token")


def hf_pipeline(model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor] | None, *, dp: Communicator,
                cp: Communicator, batch_group: Communicator, sequence_split: int = 1,
                ) -> tuple[list[nn.Module], Callable[[Any, Any], torch.Tensor], bool]:
    """(pipeline layers, loss, whether `step` cuts the targets like the inputs) of a known HuggingFace decoder.

    dp / cp: the data- and context-parallel groups (size 1: none). batch_group: the ranks splitting the global batch
    (dp x cp). loss_fn None (or hf_stages.causal_lm_loss) is HuggingFace's loss on ``step(input_ids, labels)`` over
    the global batch (`GlobalCausalLMLoss`; the labels stay whole under context parallel). A loss_fn of the user's
    gets this rank's chunks of the output and of the targets, cut alike. Mixtral's router loss is added when its
    config asks for it (the layers then pass its statistics on: hf_router_loss.py). sequence_split: the tp size
    under sequence parallel (tensor_parallel/hf_sequence.py), whose shards every decoder layer after the first
    receives.
    """
    layers = pipeline_builder(model)(model, cp=cp)
    decoders = [layer for layer in layers if isinstance(layer, hf_stages.LlamaDecoderStage)]
    for decoder in decoders[1:]:
        decoder.sequence_split = sequence_split
    default = loss_fn is None or loss_fn is hf_stages.causal_lm_loss
    split_targets = cp.size == 1 or not default
    loss = GlobalCausalLMLoss(dp, cp) if default else loss_fn
    if router_loss_coef(model) > 0:
        layers, loss = carry_router_statistics(model, layers, loss, batch_group, cp)
    return layers, loss, split_targets
