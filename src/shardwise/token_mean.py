"""A HuggingFace language model's loss over labels with -100 (padding, prompt tokens, unmasked positions): the mean
over the global batch's tokens, not the mean of the ranks' means.

HuggingFace's causal-LM, masked-LM, token-classification and sequence-to-sequence losses are the mean cross-entropy
over the labels that are not -100. Under data parallelism each rank averages over its own labels and the wrappers
average the ranks' losses, which weighs every rank alike: when the ranks hold different numbers of labels (padded
batches of unequal lengths, supervised fine-tuning that masks the prompt, BERT's random 15%), that is not one
process's mean over the global batch, and training differs silently (torch DDP too; HuggingFace's Trainer fixed it
in 2024 by passing `num_items_in_batch`, counted over the devices).

`TokenMeanLoss` is mixed into each such model by the data-parallel wrappers (batch_split.share_batch_split). After
the model's forward, when it was given `labels` (and no `num_items_in_batch` of the script's own), it counts this
rank's labels n_r the loss averaged over (a causal LM's shifted left by one, as HuggingFace shifts them), sums them
over the ranks splitting the batch (one all-reduce of one number per forward, N) and scales the cross-entropy part
of the loss by n_r x R / N: the ranks' average is then sum(all cross-entropies) / N, one process's loss. Equal counts
give a factor of exactly 1. Under `torch.no_grad()` (evaluation) nothing is exchanged and each rank's loss is its own
mean. A mixture-of-experts model's load-balancing term (`router_aux_loss_coef x aux_loss`) is
left as it is (experts/hf_aux.py makes it the global batch's). A CTC head (wav2vec2, HuBERT, WavLM) with
`ctc_loss_reduction="sum"`, HuggingFace's default, sums over the batch instead: its loss is multiplied by the number
of ranks, so their average is the global batch's sum (the gradient was that many times too small; AdamW nearly hides
it, SGD does not); with "mean" it is a mean over rows, which the ranks' average already is.

The formula is recognised, not assumed: at a model's first forward with labels its loss is recomputed from its
logits as that mean cross-entropy, with the labels paired as the model's class suggests and then the other way
(BART's, Marian's, Pegasus's ... `ForCausalLM` decoders take labels already shifted, so their loss pairs logits and
labels at the same position), and a model whose loss is neither (label smoothing, a weighted or summed loss) raises
there, naming it. (The check costs one cross-entropy over the logits, once.) A CTC head's reduction is
read from its config, not recomputed.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._mixin import mix_in
from .comm.base import Communicator, ReduceOp
from .models.hf_stages import IGNORE_INDEX, shifted_labels

__all__ = ["TokenMeanLoss", "share_token_means"]

_UNSHIFTED_LOSSES = ("ForMaskedLM", "ForTokenClassification")


def _kind(module: nn.Module) -> str | None:
    """How the model's loss pairs logits with labels: "shifted" (at t with labels at t + 1: a causal LM), "aligned"
    (at t: masked LM, token classification, an encoder-decoder's decoder), "ctc" (a CTC head), or None (left alone)."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(module, "loss_function"):
        return None
    if getattr(config, "is_encoder_decoder", False):
        return "aligned"
    # By the transformers class beneath any subclass of the script's own (whose loss is then checked, not trusted).
    names = [cls.__name__ for cls in type(module).__mro__ if cls.__module__.startswith("transformers.")]
    if any(name.endswith("ForCTC") for name in names):
        return "ctc"
    if any(name.endswith(_UNSHIFTED_LOSSES) for name in names):
        return "aligned"
    if any(name.endswith(("ForCausalLM", "LMHeadModel")) or name in _causal_lm_classes() for name in names) \
            or (any(name.endswith("ForConditionalGeneration") for name in names) and hasattr(module, "lm_head")):
        return "shifted"
    return None


@functools.cache
def _causal_lm_classes() -> frozenset[str]:
    """The class names of transformers' causal-LM auto mapping: its language models named otherwise
    (BertGenerationDecoder, ReformerModelWithLMHead), whose padded rows each rank averaged alone (a step-0 loss 0.4%
    off one process, silently). Read when a transformers model is wrapped (transformers is imported then)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return frozenset(name for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
                     for name in (value if isinstance(value, tuple) else (value,)))


def share_token_means(model: nn.Module, batch_group: Communicator, who: str) -> None:
    """Mix `TokenMeanLoss` into every HuggingFace language model inside `model` (module docstring); one that has it
    keeps the group it was given first."""
    if batch_group.size <= 1:
        return
    for module in model.modules():
        if isinstance(module, TokenMeanLoss):
            continue
        kind = _kind(module)
        if kind is not None:
            mix_in(module, TokenMeanLoss, "TokenMean")
            module._sw_token_mean = (batch_group, who, kind)
            module._sw_token_mean_checked = False


class TokenMeanLoss(nn.Module):
    """Mixed into a HuggingFace language model: its `.loss` over -100 labels is the global batch's token mean
    (module docstring). `_sw_token_mean` is (the data-parallel group, the wrapper's name, `_kind`)."""

    _sw_token_mean: tuple[Communicator, str, str]
    _sw_token_mean_checked: bool

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = super().forward(*args, **kwargs)
        if not torch.is_grad_enabled():
            return out  # evaluation: each rank's own mean, and no collective (a rank may evaluate alone)
        from .experts.hf_aux import call_arguments  # here: the experts package imports the wrappers

        given = call_arguments(self, args, kwargs)
        given.update(given.pop("kwargs", {}))
        labels = given.get("labels")
        if not isinstance(labels, torch.Tensor) or given.get("num_items_in_batch") is not None:
            return out  # no labels of HuggingFace's kind, or the script normalises the loss itself
        group, who, kind = self._sw_token_mean
        if not isinstance(out, dict):
            raise ValueError(f"{who}: {type(self).__name__} returned {type(out).__name__} for a call with labels "
                             f"(return_dict=False); its loss can be made the global batch's token mean only on its "
                             f"ModelOutput: call it with return_dict=True (the default)")
        loss = getattr(out, "loss", None)
        if loss is None:
            return out
        if kind == "ctc":  # a sum over the batch: the ranks' average is the global sum / ranks
            if getattr(self.config, "ctc_loss_reduction", None) == "sum":
                out.loss = loss * group.size
            return out
        aux = self._router_term(out, given)
        cross_entropy = loss - aux if aux is not None else loss
        if not self._sw_token_mean_checked:
            kind = self._recognise(out, labels, given, cross_entropy, kind, who)
        targets = _targets(kind, labels, given)
        here = (targets != IGNORE_INDEX).sum().to(torch.float64).reshape(1)
        total = here.clone()
        group.all_reduce(total, ReduceOp.SUM)
        scale = torch.where(total > 0, here * group.size / total.clamp(min=1), torch.ones_like(here))
        scaled = cross_entropy * scale.to(cross_entropy.dtype).reshape(())
        out.loss = scaled + aux if aux is not None else scaled
        return out

    def _router_term(self, out: Any, given: dict[str, Any]) -> torch.Tensor | None:
        """`router_aux_loss_coef x aux_loss` when the model added it to its loss (a MoE with router logits on)."""
        from .experts.hf_aux import router_logits_requested

        aux = getattr(out, "aux_loss", None)
        coef = getattr(self.config, "router_aux_loss_coef", 0)
        if aux is None or not coef or not router_logits_requested(self.config, given):
            return None
        return coef * aux.to(out.loss.device)

    def _recognise(self, out: Any, labels: torch.Tensor, given: dict[str, Any], cross_entropy: torch.Tensor,
                   kind: str, who: str) -> str:
        """The alignment of logits and labels the model's loss has, recomputed from its logits at its first forward:
        the one its class suggests, else the other (BART's, Marian's, Pegasus's ... `ForCausalLM` decoders take
        labels already shifted: their loss pairs logits and labels at the same position). Recorded for the later
        forwards; ValueError when neither is the model's loss."""
        for candidate in (kind, "aligned" if kind == "shifted" else "shifted"):
            if _is_mean_cross_entropy(out, _targets(candidate, labels, given), cross_entropy):
                group, _, _ = self._sw_token_mean
                self._sw_token_mean = (group, who, candidate)
                self._sw_token_mean_checked = True
                return candidate
        raise ValueError(
            f"{who}: {type(self).__name__}'s loss is not HuggingFace's mean cross-entropy over the labels that "
            f"are not -100 (label smoothing, a weighted or summed loss, logits not returned), so it cannot be "
            f"made the global batch's token mean: each rank would average its own labels. Compute the loss from "
            f"the logits yourself, as the sum over this rank's labels divided by their count over every rank "
            f"(an all-reduce) times the number of ranks, or pass num_items_in_batch")


def _targets(kind: str, labels: torch.Tensor, given: dict[str, Any]) -> torch.Tensor:
    """The labels the loss pairs with the logits at each position: shifted left by one for a causal LM (or the
    script's own `shift_labels`), the labels themselves for an aligned loss."""
    if kind != "shifted":
        return labels
    return given["shift_labels"] if given.get("shift_labels") is not None else shifted_labels(labels)


def _is_mean_cross_entropy(out: Any, targets: torch.Tensor, cross_entropy: torch.Tensor) -> bool:
    """Whether `cross_entropy` is the mean cross-entropy of the output's logits over the `targets` that are not
    -100 (both NaN counts: a batch with no label)."""
    logits = getattr(out, "logits", None)
    if not isinstance(logits, torch.Tensor) or logits.shape[:-1] != targets.shape:
        return False
    with torch.no_grad():
        expected = F.cross_entropy(logits.detach().float().reshape(-1, logits.shape[-1]),
                                   targets.reshape(-1).to(logits.device), ignore_index=IGNORE_INDEX)
        return bool(torch.allclose(cross_entropy.detach().float(), expected, rtol=1e-5, atol=1e-6)
                    or (expected.isnan() and cross_entropy.detach().isnan()))
