"""Every model family of one of transformers' auto mappings, built tiny from a generic config and put through
`sw.check` (tests/test_hf_families_sweep.py: `make soak`, about 23 minutes on 2 cores; two families in
`make test`).

Each family's config class is built with the size, expert and dropout fields it has set small or to zero (`TINY`,
`VISION`, `tiny_config`; load-balancing losses on); the model is built on the meta device first to count its
parameters (a sub-config the generic fields miss can make it large: skipped above `MAX_PARAMETERS`), then for real,
in float64 (a correct strategy agrees with one process to ~1e-12 there, so a difference is news, not rounding). The
batch is 4 rows of 16 tokens with labels padded unevenly (-100), so the token mean over the global batch is exercised
(classifiers: labels of 2 classes, a token classifier's padded alike; "padded_lm": with an attention mask over the
padding; "left_padded_lm": padded on the left, the first token's label -100 too, with SDPA attention (transformers'
eager attention gives left-padded rows NaN in float64); images: 4 of 3 x 32 x 32). A family whose one-process loss is
not finite on the batch is "unbuildable". `outcome` says what happened:

* "ok": every phase matched one process;
* "refused: ...": the strategy raised a clear error naming the model's part and the choice (a ValueError, or DDP's
  unused-parameter error for a model with parameters its forward does not use);
* "unbuildable: ...": the generic config does not fit the family (its own checks, a sub-config, a missing library):
  not a verdict on shardwise; "inapplicable: ...": nothing for the strategy to split (no experts, no tp plan);
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
    eos_token_id=2, rotary_dim=4, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, kv_lora_rank=16, q_lora_rank=16,
    n_group=2, topk_group=1, first_k_dense_replace=1, output_router_logits=True, router_aux_loss_coef=0.1,
    # nothing random in the forward: dropout, LayerDrop and router noise off (they differ from one process by design)
    hidden_dropout=0.0, attention_dropout=0.0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, dropout=0.0, attention_dropout_prob=0.0, classifier_dropout=0.0,
    router_jitter_noise=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0, layerdrop=0.0, dropout_rate=0.0,
    activation_dropout=0.0, residual_dropout=0.0)
#: The same for image classifiers (ViT's patches and widths, ConvNeXt's and ResNet's stages), 32 x 32 RGB images.
VISION: dict[str, Any] = dict(
    image_size=32, num_channels=3, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    intermediate_size=64, hidden_sizes=[8, 16], depths=[1, 1], embedding_size=8, embed_dim=16, num_heads=[2, 2],
    window_size=2, encoder_stride=4, mlp_ratio=2.0, layer_scale_init_value=1e-2, dims=[8, 16], num_stages=2,
    num_labels=2)
MAX_PARAMETERS = 20_000_000


def mapping(kind: str) -> dict[str, str]:
    """model type -> class name of transformers' auto mapping `kind`: "causal_lm", "masked_lm", "seq2seq",
    "seq_cls" (sequence classification), "token_cls" (token classification), "padded_lm" and "left_padded_lm" (the
    causal LMs, given an attention mask over the padding) or "image_cls" (image classification)."""
    from transformers.models.auto import modeling_auto as auto

    names = {"causal_lm": auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "masked_lm": auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
             "seq2seq": auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
             "seq_cls": auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
             "token_cls": auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
             "padded_lm": auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
             "left_padded_lm": auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
             "image_cls": auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES}[kind]
    return {model_type: cls if isinstance(cls, str) else cls[0] for model_type, cls in names.items()}


def _is_dropout(key: str, value: Any) -> bool:
    """A config field that sets a dropout probability (ALBERT's classifier_dropout_prob, DistilBERT's
    seq_classif_dropout, XLNet's summary_last_dropout ...) or stochastic depth (drop_path_rate), which the generic
    fields miss."""
    return any(word in key for word in ("dropout", "pdrop", "drop_path", "drop_connect", "stochastic_depth")) \
        and isinstance(value, float) and value > 0


def tiny_config(model_type: str, cls: Any = None, kind: str = "causal_lm") -> Any:
    """The family's config (the class's own `config_class` where the model type's is not one: a text config under a
    multimodal model type) with every `TINY` field it has passed to its constructor, so the fields it derives (a head
    size from the rotary size) agree, and every dropout probability 0. Multi-head latent attention gets as many
    key-value heads as query heads; a hybrid keeps one layer of each of its first two layer types (two
    linear-attention layers leave it no attention cache); experts run transformers' eager loop (its grouped matmul
    has no float64 kernel). An image classifier gets `VISION`'s fields."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class, own = getattr(cls, "config_class", None), CONFIG_MAPPING[model_type]
    if config_class is None or issubclass(own, config_class):  # InternLM 3's config for the LlamaForCausalLM it maps
        config_class = own
    default = config_class()
    fields = {key: value for key, value in (VISION if kind == "image_cls" else TINY).items() if hasattr(default, key)}
    fields.update({key: 0.0 for key, value in vars(default).items() if _is_dropout(key, value)})
    if hasattr(default, "kv_lora_rank"):
        fields["num_key_value_heads"] = TINY["num_attention_heads"]
    for key in ("layer_types", "mlp_layer_types"):
        types = getattr(default, key, None)
        if isinstance(types, list):
            kinds = list(dict.fromkeys(types))[:2]
            fields[key] = kinds if len(kinds) == 2 else types[:2]
    try:
        config = config_class(**fields)
    except Exception:  # noqa: BLE001 - a field its class computes or validates: set what it accepts
        config = default
        for key, value in fields.items():
            try:
                setattr(config, key, value)
            except Exception:  # noqa: BLE001
                pass
    config.classifier_dropout = 0.0  # read where set, else a head's own default (Llama's token classifier: 0.1)
    config._attn_implementation = "sdpa" if kind == "left_padded_lm" else "eager"
    try:
        config._experts_implementation = "eager"
    except Exception:  # noqa: BLE001 - a config without experts
        pass
    return config


def batch(step: int) -> dict[str, torch.Tensor]:
    """4 rows of 16 tokens (ids 3..95), the labels of rows 0 and 1 padded from 3 and 9 on."""
    ids = torch.randint(3, 96, (4, 16), generator=torch.Generator().manual_seed(step))
    labels = ids.clone()
    labels[0, 3:], labels[1, 9:] = -100, -100
    return {"input_ids": ids, "labels": labels}


def class_batch(step: int) -> dict[str, torch.Tensor]:
    """`batch`'s tokens, each row labelled with one of 2 classes (the configs' default `num_labels`)."""
    return {"input_ids": batch(step)["input_ids"], "labels": torch.tensor([0, 1, 1, 0]).roll(step)}


def token_class_batch(step: int) -> dict[str, torch.Tensor]:
    """`batch`'s tokens, each labelled with one of 2 classes, padded as `batch`'s labels (-100)."""
    tokens = batch(step)
    labels = tokens["labels"].remainder(2).where(tokens["labels"] != -100, -100)
    return {"input_ids": tokens["input_ids"], "labels": labels}


def padded_batch(step: int) -> dict[str, torch.Tensor]:
    """`batch` with an attention mask over its padding (rows 0 and 1 from 3 and 9 on), as a padded SFT batch."""
    tokens = batch(step)
    return {**tokens, "attention_mask": (tokens["labels"] != -100).long()}


def left_padded_batch(step: int) -> dict[str, torch.Tensor]:
    """`batch`'s tokens with rows 0 and 1 padded on the left (by 3 and 9), the labels -100 there and on each padded
    row's first token (its label would be scored at a padding position: refused under the stages and cp)."""
    tokens = batch(step)
    mask = torch.ones_like(tokens["input_ids"])
    mask[0, :3], mask[1, :9] = 0, 0
    labels = tokens["input_ids"].masked_fill(mask == 0, -100)
    labels[0, 3], labels[1, 9] = -100, -100
    return {"input_ids": tokens["input_ids"], "labels": labels, "attention_mask": mask}


def image_batch(step: int) -> dict[str, torch.Tensor]:
    """4 float64 images of 3 x 32 x 32, labelled with one of 2 classes."""
    pixels = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
    return {"pixel_values": pixels, "labels": torch.tensor([0, 1, 1, 0]).roll(step)}


#: The batch of each kind: language models predict their tokens, classifiers get labels of 2 classes.
BATCHES = {"seq_cls": class_batch, "token_cls": token_class_batch, "padded_lm": padded_batch,
           "left_padded_lm": left_padded_batch, "image_cls": image_batch}


def builder(model_type: str, class_name: str, kind: str = "causal_lm") -> tuple[Any, str | None]:
    """(a zero-argument builder of the float64 model, None), or (None, why it cannot be built)."""
    import transformers

    cls = getattr(transformers, class_name, None)
    if cls is None:
        return None, f"no class {class_name}"
    try:
        config = tiny_config(model_type, cls, kind)
        with torch.device("meta"):
            count = sum(p.numel() for p in cls(config).parameters())
    except Exception as exc:  # noqa: BLE001 - the family's own code refusing the generic config
        return None, f"{type(exc).__name__}: {str(exc)[:120]}"
    if count > MAX_PARAMETERS:
        return None, f"{count:,} parameters with the generic config"

    def build() -> torch.nn.Module:  # sw.check builds each copy under its own seed and lock
        return cls(config).double()

    for retry in (False, True):  # one process runs it at all
        try:
            loss = build()(**BATCHES.get(kind, batch)(0)).loss
            loss.backward()
            if not torch.isfinite(loss):
                return None, f"one process's loss is {float(loss)}"
            return build, None
        except Exception as exc:  # noqa: BLE001
            if retry or not getattr(config, "output_router_logits", False):
                return None, f"{type(exc).__name__}: {str(exc)[:120]}"
            config.output_router_logits = False  # a family whose own load-balancing loss fails (Flint, NLLB-MoE)
    raise AssertionError("unreachable")


#: Strategies that apply to some families only: why a family's config leaves them nothing to do.
NEEDS = {"ep": ("output_router_logits", "no experts"), "tp:hf": ("base_model_tp_plan", "no tensor-parallel plan")}
def zero3_sync(model: torch.nn.Module, comm: Any) -> torch.nn.Module:
    """ZeRO-3 with every BatchNorm normalising by the global batch (batch_norm="sync")."""
    import shardwise as sw

    return sw.ZeRO(model, comm, stage=3, batch_norm="sync")


#: The sweep's names of mesh and wrapper strategies: experts, pipeline stages, sequences split over 2 ranks, tensor
#: parallel with sequence parallel (plan "llama": MoE blocks, recurrent mixers and latent attention on the whole
#: sequence).
MESHES = {"ep": {"ep": 2}, "pp": {"pp": 2}, "cp": {"cp": 2}, "zero3+sync": zero3_sync,
          "sp": {"tp": 2, "tp_plan": "llama", "sequence_parallel": True}}


def outcome(model_type: str, class_name: str, strategy: Any, kind: str = "causal_lm") -> str:
    """What `sw.check` makes of the family under `strategy` (module docstring; "ep" / "pp" / "cp" / "sp": experts,
    pipeline stages, sequences over 2 ranks, tensor and sequence parallel (`MESHES`); "tp:hf": the family's own
    tensor-parallel plan over 2 ranks; "ep" and "tp:hf" are "inapplicable: ..." for a family with nothing to
    split)."""
    import shardwise as sw

    build, why = builder(model_type, class_name, kind)
    if build is None:
        return f"unbuildable: {why}"
    if isinstance(strategy, str):
        if strategy in NEEDS and getattr(build().config, NEEDS[strategy][0], None) in (None, {}):
            return f"inapplicable: {NEEDS[strategy][1]}"
        strategy = MESHES.get(strategy, strategy)
    try:
        report = sw.check(build, BATCHES.get(kind, batch), strategy=strategy, world_size=2, steps=2, timeout=120)
    except ValueError as exc:
        return f"refused: {str(exc)[:160]}"
    except sw.LaunchError as exc:
        if "got no gradient in this backward pass" in exc.summary:  # DDP's unused parameters, named
            return f"refused: {exc.summary[:160]}"
        raise
    return "ok" if report.ok else f"DIFFERS: {report.first_mismatch} {report.notes}"
