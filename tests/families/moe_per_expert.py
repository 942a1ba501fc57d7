"""moe_per_expert: HuggingFace ``SwitchTransformersForConditionalGeneration``, tiny: top-1 (Switch) routing to
experts that are one ``nn.Module`` each (``experts.expert_<i>.wi`` / ``.wo``), so an expert that gets no token gets
NO gradient (grad None) in one process, and the set of experts used differs between data-parallel ranks.

Model: vocab 64, d_model 32, d_kv 8, 4 heads, d_ff 32; 1 encoder + 1 decoder layer, both sparse (8 experts each,
expert capacity 16 per sequence >= the sequence lengths, so no token is dropped); T5-style relative position
bias (in layer 0 of each stack); RMS-style LayerNorm without bias; dropout 0; router jitter 0; fp32; eager
attention. 48,096 parameters in 56 tensors (59 names with the ties, 59 state-dict keys).

Router losses OFF: ``output_router_logits=False`` (z-loss and load-balancing loss are not computed, and their
coefficients are 0 as well). Routing is argmax per token and capacity is counted per sequence, so it is row-local:
equal slices average to the whole batch's loss.

Ties (5.23 ``_tied_weights_keys`` with ``tie_word_embeddings=True``): ``shared.weight`` IS
``encoder.embed_tokens.weight`` IS ``decoder.embed_tokens.weight`` IS ``lm_head.weight`` (listed once, as
``shared.weight``); the decoder's output is scaled by d_model ** -0.5 before the tied head. No buffers.

Quirks: the router runs ``self.classifier = self.classifier.to(float32)`` inside every forward (a Module.to on a
parameter-holding module during the step: a no-op in fp32, but it would upcast the router's parameters in place
under a bf16 mixed-precision policy); ``experts`` is an ``nn.ModuleDict`` that is also called.

Batch: encoder 8 x 8 tokens, labels 8 x 6 tokens, no padding. Rows 0-3 draw their tokens from ids 8..11 and rows
4-7 from ids 40..43. ``build()`` then steers the routing (see ``_structure_routing``: router rows and the embedding
rows of these tokens from a fixed generator, whatever torch's seed), so that in BOTH sparse layers (encoder and
decoder), at every one of the first 3 steps: expert 0 gets tokens from both halves, expert 1 only from rows 0-3,
expert 2 only from rows 4-7, experts 3-7 from nobody (EXPECTED_USAGE; checked for torch seeds 0..19 over 3 AdamW
steps). In one process on the whole batch, experts 3-7 (wi and wo: 10 tensors per sparse layer, 20 in all) have
grad None; on 2 data-parallel ranks, rank 0 (rows 0-3) also leaves expert 2 unused and rank 1 (rows 4-7) expert 1,
so the ranks' grad-None sets differ from each other and from the reference's.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB, D_MODEL, D_KV, HEADS, D_FF, EXPERTS, SRC, TGT, BATCH = 64, 32, 8, 4, 32, 8, 8, 6, 8
HALF_IDS = ((8, 12), (40, 44))  # token ranges of rows 0..3 and rows 4..7
# The expert each token is steered to: rows 0-3 use experts {0, 1}, rows 4-7 experts {0, 2} (the decoder's start
# token 0 goes to expert 0), experts 3..7 get nothing.
ROUTES = {0: 0, 8: 1, 9: 1, 10: 0, 11: 0, 40: 2, 41: 2, 42: 0, 43: 0}
EMB_SCALE, ROUTER_SCALE = 12.0, 1.0
SPARSE_LAYERS = ("encoder.block.0.layer.1.mlp", "decoder.block.0.layer.2.mlp")
# {sparse layer: (experts used by the whole batch, by rows 0-3, by rows 4-7)} at steps 0, 1 and 2
EXPECTED_USAGE = {layer: ({0, 1, 2}, {0, 1}, {0, 2}) for layer in SPARSE_LAYERS}

NOTES = ("one nn.Module per expert, top-1 routing: experts no token reaches have grad None, and the set of "
         "experts used differs between data-parallel ranks (some unused everywhere, some by one half only); "
         "embedding shared by encoder, decoder and lm_head; router .to(float32) inside forward")
MAX_NORM = 0.5
TP_PLAN = None


def build() -> nn.Module:
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    config = SwitchTransformersConfig(
        vocab_size=VOCAB, d_model=D_MODEL, d_kv=D_KV, d_ff=D_FF, expert_capacity=16, num_layers=1,
        num_sparse_encoder_layers=1, num_decoder_layers=1, num_sparse_decoder_layers=1, num_heads=HEADS,
        num_experts=EXPERTS, router_bias=False, router_jitter_noise=0.0, router_z_loss_coef=0.0,
        router_aux_loss_coef=0.0, output_router_logits=False, dropout_rate=0.0, tie_word_embeddings=True,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, attn_implementation="eager")
    model = SwitchTransformersForConditionalGeneration(config)
    _structure_routing(model)
    return model


def _structure_routing(model: nn.Module) -> None:
    """Make the expert usage a property of the family, not of torch's seed (see the module docstring).

    From a fixed generator: orthonormal directions q_0..q_7 of the model space; each router's rows are
    ROUTER_SCALE * q_k, and the embedding rows of the batch's tokens are EMB_SCALE * q_k + noise for the expert k
    they are meant for (ROUTES). The attention and cross-attention outputs added to the residual stream have the
    norm of a layer-normed vector (about sqrt(d_model)), well below EMB_SCALE, so every router sees its token's
    direction first. All other weights keep HuggingFace's initialisation from torch's seed.
    """
    g = torch.Generator().manual_seed(5)
    q, _ = torch.linalg.qr(torch.randn(D_MODEL, D_MODEL, generator=g))
    q = q.T[:EXPERTS]
    with torch.no_grad():
        for name, module in model.named_modules():
            if type(module).__name__ == "SwitchTransformersTop1Router":
                module.classifier.weight.copy_(ROUTER_SCALE * q)
        shared = model.shared.weight
        for token, expert in ROUTES.items():
            shared[token] = EMB_SCALE * q[expert] + torch.randn(D_MODEL, generator=g)


def batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5000 + step)
    half = BATCH // 2
    src = torch.cat([torch.randint(lo, hi, (half, SRC), generator=g) for lo, hi in HALF_IDS])
    tgt = torch.cat([torch.randint(lo, hi, (half, TGT), generator=g) for lo, hi in HALF_IDS])
    return {"input_ids": src, "attention_mask": torch.ones(BATCH, SRC, dtype=torch.long), "labels": tgt}


def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch, output_router_logits=False).loss


def expert_usage(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, set[int]]:
    """{sparse layer name: indices of the experts that received at least one token} for one forward (no grad)."""
    used: dict[str, set[int]] = {}
    hooks = []
    for name, module in model.named_modules():
        if type(module).__name__ == "SwitchTransformersTop1Router":
            def hook(mod, args, out, name=name):  # noqa: ANN001, ANN202
                used[name.rsplit(".router", 1)[0]] = set(out[0].sum(dim=(0, 1)).nonzero().flatten().tolist())
            hooks.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            loss(model, batch)
    finally:
        for h in hooks:
            h.remove()
    return used
