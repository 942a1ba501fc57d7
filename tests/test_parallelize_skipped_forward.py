"""`sw.parallelize` runs the model's layers in pipeline stages and never calls the model's own forward
(skipped_forward.py): a forward hook on the model itself, or a subclass overriding forward but inheriting the layers,
is refused by name instead of skipped silently; a hook on a layer runs as in one process."""

from __future__ import annotations

import pytest
import torch
from parity import CONFIG, batch, value_error_text
from torch import nn

import shardwise as sw
from shardwise.models import GPT


class ScaledGPT(GPT):
    """Overrides forward (a changed output) and inherits pipeline_layers(): the change would never run."""

    def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        return super().forward(*args, **kwargs) * 0.5


class Tracker(nn.Module):
    """Accumulates the mean of the activations it sees (a buffer written in forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros((), dtype=torch.float64))

    def forward(self, hidden: torch.Tensor) -> None:
        self.seen += hidden.detach().double().mean()


def refusal(build) -> str | None:  # noqa: ANN001
    return sw.launch(lambda comm: value_error_text(lambda: sw.parallelize(build(), sw.Mesh(comm, dp=1))), 1)[0]


@pytest.mark.parametrize("kind", ["pre-hook", "hook"])
def test_a_hook_on_the_model_itself_is_refused(kind: str) -> None:
    def build() -> GPT:
        gpt = GPT(CONFIG, seed=0)
        if kind == "pre-hook":
            gpt.register_forward_pre_hook(lambda module, args: None)
        else:
            gpt.register_forward_hook(lambda module, args, output: None)
        return gpt

    text = refusal(build)
    assert text is not None and f"GPT has a forward {kind} on the model itself" in text and "on a layer" in text


def test_an_overridden_forward_is_refused() -> None:
    text = refusal(lambda: ScaledGPT(CONFIG, seed=0))
    assert text is not None and "ScaledGPT overrides forward of GPT" in text


def test_an_overridden_huggingface_forward_is_refused() -> None:
    transformers = pytest.importorskip("transformers")

    class Shifted(transformers.LlamaForCausalLM):
        def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
            return super().forward(*args, **kwargs)

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    text = refusal(lambda: Shifted(config))
    assert text is not None and "Shifted overrides forward of LlamaForCausalLM" in text


def test_a_hook_on_a_layer_runs_as_in_one_process() -> None:
    def build() -> GPT:
        gpt = GPT(CONFIG, seed=0)
        gpt.blocks[0].tracker = Tracker()
        gpt.blocks[0].register_forward_pre_hook(lambda module, args: module.tracker(args[0]))
        return gpt

    plain = build()
    x, y = batch(0)
    plain(x, y)

    def body(comm: sw.Communicator) -> float:
        gpt = build()
        model = sw.parallelize(gpt, sw.Mesh(comm, dp=1), n_microbatches=1)
        model.step(x, y)
        return float(gpt.blocks[0].tracker.seen)  # the stage holds the same layer objects

    assert sw.launch(body, 1) == [pytest.approx(float(plain.blocks[0].tracker.seen), rel=1e-12)]
