"""Shared HuggingFace model of the context-parallel tests: a tiny Llama with grouped-query heads (4 query heads over
2 key/value heads), eager attention and rotary positions, built the same on every thread rank."""

from __future__ import annotations

import threading

import torch

_BUILD = threading.Lock()


def tiny_llama():  # noqa: ANN201 (transformers is imported lazily: only these tests need it)
    """LlamaForCausalLM, vocab 128, hidden 64, 2 layers, untied head, seed 0."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False, attn_implementation="eager")
    with _BUILD:  # thread ranks share torch's global RNG
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config)
