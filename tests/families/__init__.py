"""Model families of the test model matrix (issue 28): third-party and hand-written models, tiny, each a module.

Every family module exposes:

``build() -> nn.Module``
    A fresh model in training mode, tiny (hidden 32, 1-2 layers, vocabulary 64), every dropout 0, fp32, and
    deterministic given torch's global seed (the caller seeds: ``torch.manual_seed(seed); build()``). Nothing else
    of torch's global RNG is drawn after build: no forward draws random numbers.
``batch(step: int) -> dict[str, Tensor]``
    The GLOBAL batch of a step, 8 examples along dim 0 of every tensor, drawn from its own
    ``torch.Generator().manual_seed(...)`` (never the global RNG): the same on every call and every rank.
``loss(model, batch) -> Tensor``
    A scalar that is an equal-weight MEAN over the batch's examples, so that the mean of the losses of N
    contiguous equal slices (N in 1, 2, 4, 8) equals the loss of the whole batch, and so do the gradients: the
    data-parallel parity precondition. Masked-LM labels are 3 per row, no padding varies per row, and MoE router
    auxiliary / z-losses are off. The one exception is ``convnet_bn``, whose BatchNorm couples the examples of a
    slice: its parity needs ``sw.SyncBatchNorm.convert``.
``MAX_NORM: float``
    A gradient-clip threshold below the global gradient norm of each of the first 3 steps of AdamW(lr=1e-3,
    weight_decay=0.1) with this clip, so the clip binds at every step.
``TP_PLAN: dict | None``
    A tensor-parallel plan (module-name pattern -> style, see ``shardwise.tensor_parallel.plans``) for the
    families tested with tensor parallel (``encoder_mlm``, ``decoder_tied``); None elsewhere. LM heads under
    HuggingFace's own loss use ``Colwise(gather_output=True)`` (the loss needs whole logits), the only non-string
    style in them.
``NOTES: str``
    One line: what about the family stresses a parallel library. Each module's docstring gives parameter and
    tensor counts, ties, buffers and dtype.

Numerical trap (measured): attention KEY biases (BERT ``key.bias``, Bart ``k_proj.bias``, ViT ``k_proj.bias``)
have an exactly zero true gradient (softmax is invariant to the score shift q . b_k), so their gradient is rounding
noise, and AdamW with its default eps=1e-8 turns noise of ~1e-9 into updates of ~lr x 0.1: two correct runs that
sum in a different order (data-parallel slices, tensor-parallel shards) then differ by ~1e-6 there. Emulating
2- and 4-rank data parallel in one process, vit misses rtol 1e-5 / atol 1e-6 after 3 steps at eps=1e-8
(k_proj.bias, 1.4e-6) and every family except convnet_bn passes at eps=1e-6; encoder_mlm under 2-way tensor
parallel misses it at eps=1e-8 (attention.output.dense.weight, 1.5e-6; float64: 1e-16) and passes at eps=1e-6.
Use ``AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-6)`` in the matrix.

Usage: ``from families import FAMILIES; fam = FAMILIES["decoder_tied"]; sw.check(fam.build, fam.batch,
strategy=..., loss_fn=fam.loss, max_norm=fam.MAX_NORM)``. The HuggingFace families import transformers inside
``build()`` only. These modules are data for tests, not tests (no ``test_`` names).
"""

from __future__ import annotations

from types import ModuleType

from . import convnet_bn, decoder_tied, encoder_decoder, encoder_mlm, frozen, moe_fused, moe_per_expert, vit

FAMILIES: dict[str, ModuleType] = {
    "encoder_mlm": encoder_mlm,
    "encoder_decoder": encoder_decoder,
    "decoder_tied": decoder_tied,
    "moe_fused": moe_fused,
    "moe_per_expert": moe_per_expert,
    "vit": vit,
    "convnet_bn": convnet_bn,
    "frozen": frozen,
}

__all__ = ["FAMILIES"]
