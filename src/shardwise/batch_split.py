"""Modules that compute a statistic of the whole batch learn which ranks split it.

A mixture-of-experts layer's load-balancing loss is a product of two batch means (models/moe.py), so averaging
per-rank losses is not one process's loss; SyncBatchNorm is the same kind of thing for BatchNorm. Such a module
offers `set_batch_group(comm)`; every data-parallel wrapper (DDP, ZeRO, FSDP) calls `share_batch_split(model, comm)`
at wrap time with the group it averages gradients over, so the module sums its statistics over that group. The
model declares what it needs; the strategies only ask. A HuggingFace MoE (Mixtral's loss: output_router_logits,
router_aux_loss_coef) declares nothing, so its loss is made the global batch's here (experts/hf_aux.py), and so is
a dual encoder's contrastive loss (CLIP, SigLIP: contrastive.py), and a language model's mean over the labels that are
not -100 (token_mean.py).
"""

from __future__ import annotations

from torch import nn

from .comm.base import Communicator

__all__ = ["share_batch_split", "refuse_unsplittable_batch_statistics"]


def share_batch_split(model: nn.Module, comm: Communicator, who: str) -> None:
    """Tell every submodule of `model` that offers `set_batch_group` that the ranks of `comm` split the batch, and
    make a HuggingFace MoE's load-balancing loss the global batch's over them (experts/hf_aux.py); `who` names
    the wrapper in what a forward that cannot be made so raises."""
    # Imported here: the experts package imports the wrappers that call this (the module itself imports none).
    from .contrastive import share_contrastive_losses
    from .experts.hf_aux import share_router_losses
    from .token_mean import share_token_means

    for module in model.modules():
        setter = getattr(module, "set_batch_group", None)
        if callable(setter):
            setter(comm)
    share_router_losses(model, comm, who)
    share_contrastive_losses(model, comm, who)
    share_token_means(model, comm, who)


def refuse_unsplittable_batch_statistics(model: nn.Module, comm: Communicator, who: str) -> None:
    """What `share_batch_split` cannot make the global batch's, refused by the wrapper `who` before it changes the
    model (experts/hf_aux.py: a HuggingFace MoE whose load-balancing loss is not Mixtral's)."""
    from .experts.hf_aux import refuse_local_router_losses  # here, as in share_batch_split

    refuse_local_router_losses(model, comm, who)
