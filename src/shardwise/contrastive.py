"""A HuggingFace dual encoder's contrastive loss over the global batch when data-parallel ranks split the batch.

CLIP (Radford et al. 2021, arXiv 2103.00020) and SigLIP (Zhai et al. 2023, arXiv 2303.15343) score every text of
the batch against every image: with ``return_loss=True`` a HuggingFace ``CLIPModel`` / ``SiglipModel`` (and the
dual encoders built the same way: AltCLIP, Chinese-CLIP, MetaCLIP 2, X-CLIP, CLAP ...) returns the loss over the
n x n similarities of the rows it was given. Under data parallelism each rank would score its n rows against its own
n only, a different loss than one process's over N x N (the data-parallel average of the ranks' losses is not it),
silently. open_clip's answer is to all-gather the embeddings with their gradient (``gather_with_grad``,
``local_loss``): rank r scores its own n texts against all N images (and its n images against all N texts), so the
mean of the ranks' losses is one process's loss and, with the gather's backward summing the gradients over the ranks,
the data-parallel mean of the gradients is one process's gradient.

`share_contrastive_losses` (called with the wrappers' group by batch_split.share_batch_split) mixes
`GlobalContrastiveLoss` into every module holding a learned ``logit_scale``. At a forward that returns a loss with
``logits_per_text``, ``text_embeds`` and ``image_embeds``, it first recomputes this rank's own loss from the
embeddings by CLIP's formula (cross-entropy both ways) and by SigLIP's (pairwise log-sigmoid with ``logit_bias``):
the one that equals the model's loss is the model's, and the loss returned is that formula over the global batch.
A loss neither formula reproduces (BLIP's, which adds its matching losses) is refused at that forward, naming the
model: it cannot be made the global batch's. A loss computed by the script from the logits (``return_loss=False``)
is the script's: it sees this rank's n x n logits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._mixin import mix_in
from .comm.base import Communicator

__all__ = ["GlobalContrastiveLoss", "share_contrastive_losses"]


def share_contrastive_losses(model: nn.Module, batch_group: Communicator, who: str) -> None:
    """Mix `GlobalContrastiveLoss` into each module of `model` with a learned `logit_scale` (module docstring); one
    that has it keeps its first group."""
    if batch_group.size <= 1:
        return
    for module in model.modules():
        if isinstance(module, GlobalContrastiveLoss) or not isinstance(getattr(module, "logit_scale", None),
                                                                        torch.Tensor):
            continue
        mix_in(module, GlobalContrastiveLoss, "GlobalContrastive")
        module._sw_contrastive = (batch_group, who)


def _rows_of_everyone(text: torch.Tensor, image: torch.Tensor,
                      group: Communicator) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Every rank's rows of the text and image embeddings, in rank order, differentiable (the gradient of this rank's
    rows is summed over the ranks), and where this rank's rows start: one exchange of the row counts and one sum of
    both embeddings side by side (they have one width: the model takes their dot products)."""
    from .experts.ops import sum_over_ranks  # here: the experts package imports the wrappers, which import this

    counts = torch.zeros(group.size, dtype=torch.float32, device=group.device)
    counts[group.rank] = text.shape[0]
    group.all_reduce(counts)
    sizes = [int(c) for c in counts.tolist()]
    start = sum(sizes[:group.rank])
    both = torch.cat([text, image], dim=1)
    padded = both.new_zeros((sum(sizes), both.shape[1]))
    padded = padded.index_copy(0, torch.arange(start, start + both.shape[0], device=both.device), both)
    texts, images = sum_over_ranks(padded, group).split(text.shape[1], dim=1)
    return texts, images, start


def _clip_loss(per_text: torch.Tensor, per_image: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return (F.cross_entropy(per_text, rows) + F.cross_entropy(per_image, rows)) / 2


def _siglip_loss(per_text: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    signs = -torch.ones_like(per_text)
    signs[torch.arange(per_text.shape[0], device=per_text.device), rows] = 1
    return -F.logsigmoid(signs * per_text).sum(dim=-1).mean()


class GlobalContrastiveLoss(nn.Module):
    """Mixed into a dual encoder by `share_contrastive_losses`: its `loss` is the global batch's (module docstring).
    `_sw_contrastive` is (the data-parallel group, the wrapper's name)."""

    _sw_contrastive: tuple[Communicator, str]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = super().forward(*args, **kwargs)
        if not isinstance(out, dict) or out.get("loss") is None or out.get("logits_per_text") is None:
            if isinstance(out, tuple) and kwargs.get("return_loss"):
                raise ValueError(f"{type(self).__name__} over data-parallel ranks returned a tuple with "
                                 f"return_loss=True: its contrastive loss can be made the global batch's only on its "
                                 f"ModelOutput: call it with return_dict=True (the default)")
            return out
        group, who = self._sw_contrastive
        text, image = out.text_embeds, out.image_embeds
        scale = self.logit_scale.exp()
        bias = getattr(self, "logit_bias", None)
        bias = bias if isinstance(bias, torch.Tensor) else None
        per_text = text @ image.t() * scale + (bias if bias is not None else 0)
        own = torch.arange(text.shape[0], device=text.device)
        kind = None
        if torch.allclose(per_text, out.logits_per_text, rtol=1e-4, atol=1e-5):
            with torch.no_grad():
                if torch.allclose(_clip_loss(per_text, per_text.t(), own), out.loss, rtol=1e-4, atol=1e-5):
                    kind = "clip"
                elif bias is not None and torch.allclose(_siglip_loss(per_text, own), out.loss, rtol=1e-4,
                                                         atol=1e-5):
                    kind = "siglip"
        if kind is None:
            raise ValueError(f"{who} over {group.size} ranks: {type(self).__name__}'s loss scores the batch's texts "
                             f"against its images, but is neither CLIP's nor SigLIP's contrastive loss of its "
                             f"logits_per_text, so it cannot be made the global batch's and each rank would compute "
                             f"it over its own rows; call it with return_loss=False and compute the loss from "
                             f"embeddings gathered over the data-parallel group")
        texts, images, start = _rows_of_everyone(text, image, group)
        rows = own + start
        per_text = text @ images.t() * scale + (bias if bias is not None else 0)
        if kind == "clip":
            out.loss = _clip_loss(per_text, image @ texts.t() * scale, rows)
        else:
            out.loss = _siglip_loss(per_text, rows)
        return out


