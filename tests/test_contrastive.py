"""A HuggingFace dual encoder's contrastive loss is the global batch's under data parallelism (contrastive.py):
CLIP's and SigLIP's built-in losses (return_loss=True) score each rank's texts against every rank's images, so
training matches one process on the global batch. Before, each rank scored its rows against its own only: CLIP's
step-0 loss was 1.2059 against 1.8322 in one process, silently. A loss that is neither formula is refused."""

from __future__ import annotations

import threading

import pytest
import torch

import shardwise as sw

transformers = pytest.importorskip("transformers")
_BUILD = threading.Lock()  # HuggingFace initialises from torch's global RNG, which thread ranks share
TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            max_position_embeddings=16)
VISION = dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
              num_attention_heads=4)


def clip():
    with _BUILD:
        torch.manual_seed(0)
        return transformers.CLIPModel(transformers.CLIPConfig(text_config=TEXT, vision_config=VISION,
                                                              projection_dim=16))


def siglip():
    with _BUILD:
        torch.manual_seed(0)
        return transformers.SiglipModel(transformers.SiglipConfig(text_config=TEXT, vision_config=VISION))


def batch(step):
    g = torch.Generator().manual_seed(step)
    return {"input_ids": torch.randint(0, 64, (4, 8), generator=g),
            "pixel_values": torch.randn(4, 3, 32, 32, generator=g), "return_loss": True}


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-5)


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
@pytest.mark.parametrize("model", [clip, siglip], ids=["clip", "siglip"])
def test_the_contrastive_loss_is_the_global_batch_one(model, strategy):
    report = sw.check(model, batch, strategy=strategy, world_size=2, steps=2, rtol=1e-4, atol=1e-5, optimizer=adamw)
    assert report.ok, str(report)


class DoubledLoss(transformers.CLIPModel):
    """A user's subclass whose loss is not CLIP's contrastive loss of its logits."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if out.loss is not None:
            out.loss = 2 * out.loss
        return out


def test_a_loss_that_is_neither_formula_is_refused():
    def body(comm):
        config = clip().config
        with _BUILD:
            torch.manual_seed(0)
            model = DoubledLoss(config)
        model = sw.DDP(model, comm)
        rows = {k: v[comm.rank * 2:(comm.rank + 1) * 2] if isinstance(v, torch.Tensor) else v
                for k, v in batch(0).items()}
        with pytest.raises(ValueError, match=r"DDP over 2 ranks: .*DoubledLoss's loss scores the batch's texts "
                                             r"against its images, but is neither CLIP's nor SigLIP's"):
            model(**rows)
        model(**{**rows, "return_loss": False})  # the script's own loss: its business
        return True

    assert sw.launch(body, 2) == [True, True]
