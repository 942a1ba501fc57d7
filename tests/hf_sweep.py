"""Every model family of one of transformers' auto mappings, built tiny from a generic config and put through
`sw.check` (tests/test_hf_families_sweep.py: `make soak`, about 4 minutes on 2 cores; two families in
`make test`).

Each family's config class is built with its defaults, then every size and dropout field it has is set small or to
zero (`TINY`); the model is built on the meta device first to count its parameters (a sub-config the generic fields
miss can make it large: skipped above `MAX_PARAMETERS`), then for real, in float64 (a correct strategy agrees with
one process to ~1e-12 there, so a difference is news, not rounding). The batch is 4 rows of 16 tokens with labels
padded unevenly (-100), so the token mean over the global batch is exercised. `outcome` says what happened:

* "ok": every phase matched one process;
* "refused: ...": the strategy raised a clear error naming the model's part and the choice (a ValueError, or DDP's
  unused-parameter error for a model with parameters its forward does not use);
* "unbuildable: ...": the generic config does not fit the family (its own checks, a sub-config, a missing library):
  not a verdict on shardwise;
* "DIFFERS: ..." (with the report's first mismatch and notes): the one outcome that fails the sweep.
"""

from __future__ import annotations

from typing import Any

import torch

#: The generic small values set on every config field of these names that the family's config has.
TINY: dict[str, Any] = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64, n_embd=32, n_layer=2, n_head=4, d_model=32,
    n_positions=64, ffn_dim=64, num_layers=2, num_heads=4, d_ff=64, d_kv=8, embedding_size=32, n_inner=64,
    num_local_experts=4, num_experts=4, num_experts_per_tok=2, n_routed_experts=4, moe_intermediate_size=32,
    max_seq_len=64, seq_length=64, encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_layers=2, decoder_layers=2,
    encoder_attention_heads=4, decoder_attention_heads=4, num_decoder_layers=2, pad_token_id=0, bos_token_id=1,
    eos_token_id=2,
    # nothing random in the forward: dropout, LayerDrop and router noise off (they differ from one process by design)
    hidden_dropout=0.0, attention_dropout=0.0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, dropout=0.0, attention_dropout_prob=0.0, classifier_dropout=0.0,
    router_jitter_noise=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0, layerdrop=0.0, dropout_rate=0.0,
    activation_dropout=0.0, residual_dropout=0.0)
MAX_PARAMETERS = 20_000_000


def mapping(kind: str) -> dict[str, str]:
    """model type -> class name of transformers' auto mapping `kind`: "causal_lm", "masked_lm" or "seq2seq"."""
    from transformers.models.auto import modeling_auto as auto

    names = {"causal_lm": auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "masked_lm": auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
             "seq2seq": auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES}[kind]
    return {model_type: cls if isinstance(cls, str) else cls[0] for model_type, cls in names.items()}


def tiny_config(model_type: str) -> Any:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type]()
    for key, value in TINY.items():
        if hasattr(config, key):
            try:
                setattr(config, key, value)
            except Exception:  # noqa: BLE001 - a field its class computes or validates: keep the family's own
                pass
    for key in ("layer_types", "mlp_layer_types"):
        if isinstance(getattr(config, key, None), list):
            try:
                setattr(config, key, getattr(config, key)[:2])
            except Exception:  # noqa: BLE001
                pass
    config._attn_implementation = "eager"
    return config


def batch(step: int) -> dict[str, torch.Tensor]:
    """4 rows of 16 tokens (ids 3..95), the labels of rows 0 and 1 padded from 3 and 9 on."""
    ids = torch.randint(3, 96, (4, 16), generator=torch.Generator().manual_seed(step))
    labels = ids.clone()
    labels[0, 3:], labels[1, 9:] = -100, -100
    return {"input_ids": ids, "labels": labels}


def builder(model_type: str, class_name: str) -> tuple[Any, str | None]:
    """(a zero-argument builder of the float64 model, None), or (None, why it cannot be built)."""
    import transformers

    cls = getattr(transformers, class_name, None)
    if cls is None:
        return None, f"no class {class_name}"
    try:
        config = tiny_config(model_type)
        with torch.device("meta"):
            count = sum(p.numel() for p in cls(config).parameters())
        if count > MAX_PARAMETERS:
            return None, f"{count:,} parameters with the generic config"

        def build() -> torch.nn.Module:  # sw.check builds each copy under its own seed and lock
            return cls(config).double()

        build()(**batch(0)).loss.backward()  # one process runs it at all
    except Exception as exc:  # noqa: BLE001 - the family's own code refusing the generic config
        return None, f"{type(exc).__name__}: {str(exc)[:120]}"
    return build, None


def outcome(model_type: str, class_name: str, strategy: Any) -> str:
    """What `sw.check` makes of the family under `strategy` (module docstring)."""
    import shardwise as sw

    build, why = builder(model_type, class_name)
    if build is None:
        return f"unbuildable: {why}"
    try:
        report = sw.check(build, batch, strategy=strategy, world_size=2, steps=2, timeout=120)
    except ValueError as exc:
        return f"refused: {str(exc)[:160]}"
    except sw.LaunchError as exc:
        if "got no gradient in this backward pass" in exc.summary:  # DDP's unused parameters, named
            return f"refused: {exc.summary[:160]}"
        raise
    return "ok" if report.ok else f"DIFFERS: {report.first_mismatch} {report.notes}"
