"""vit: HuggingFace ``ViTForImageClassification``, tiny: 8 x 8 RGB images, 4 x 4 patches (4 patches + [CLS]).

Model: hidden 32, 2 layers, 4 heads, intermediate 64, 5 classes; dropout 0; fp32; eager attention. 19,077
parameters in 40 tensors, 40 state-dict keys.
Parameters include the [CLS] token ``vit.embeddings.cls_token`` (1, 1, 32) and the position embeddings (1, 5, 32),
bare Parameters of ``vit.embeddings`` (not weights of a Linear / Embedding), and a Conv2d patch embedding (4-D
weight). No pooler (``add_pooling_layer=False`` in the classification model). transformers 5.23 names the layers
``vit.layers.<i>.attention.{q,k,v,o}_proj`` and ``vit.layers.<i>.mlp.fc1/fc2`` (4.x had
``vit.encoder.layer.<i>.attention.attention.query`` ...). Ties: none. Buffers: none.

``problem_type="single_label_classification"`` is set in the config: left None, HuggingFace's loss would write it
into ``model.config`` during the first forward (a forward that mutates shared state).

Batch: ``pixel_values`` (8, 3, 8, 8) standard normal, ``labels`` (8,) in 0..4. Loss: CrossEntropyLoss(mean) over
the 8 images: equal slices average to the whole batch's loss.

Zero-gradient parameters: every attention key bias (``attention.k_proj.bias``) has an exactly zero true
gradient (softmax ignores the shift q . b_k), so its computed gradient is rounding noise: see the package
docstring (families/__init__.py) for AdamW's eps.
"""

from __future__ import annotations

import torch
from torch import nn

IMAGE, PATCH, CHANNELS, HIDDEN, LAYERS, HEADS, FFN, CLASSES, BATCH = 8, 4, 3, 32, 2, 4, 64, 5, 8

NOTES = ("image input (B, C, H, W), Conv2d patch embedding (4-D weight), bare nn.Parameters ([CLS] token, position "
         "embeddings) outside any Linear/Embedding; per-example classification loss")
MAX_NORM = 0.5
TP_PLAN = None


def build() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=IMAGE, patch_size=PATCH, num_channels=CHANNELS, hidden_size=HIDDEN,
                       num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FFN,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=CLASSES,
                       problem_type="single_label_classification", attn_implementation="eager")
    return ViTForImageClassification(config)


def batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(6000 + step)
    return {"pixel_values": torch.randn(BATCH, CHANNELS, IMAGE, IMAGE, generator=g),
            "labels": torch.randint(0, CLASSES, (BATCH,), generator=g)}


def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss
