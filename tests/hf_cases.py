"""Shared HuggingFace models of the tests, built the same on every thread rank: a tiny Llama with grouped-query heads
(4 query heads over 2 key/value heads), eager attention and rotary positions; Gemma 2 with a soft cap its scores
reach; GPT-OSS with attention sinks and experts; a tiny T5 (an encoder-decoder, its embedding shared)."""

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


def tiny_t5():  # noqa: ANN201
    """T5ForConditionalGeneration, vocab 64, d_model 32, 2 layers each side, no dropout, in eval mode, seed 0."""
    import transformers

    return build(transformers.T5ForConditionalGeneration, transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
        relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)).eval()


def build(cls, config):  # noqa: ANN001, ANN201
    with _BUILD:  # thread ranks share torch's global RNG
        torch.manual_seed(0)
        return cls(config)


def gemma2():  # noqa: ANN201
    """Gemma 2 with a small attention soft cap (its default 50 bends only large scores) and no final-logit cap; the
    query and key projections are scaled up so that the scores reach the cap (at initialization they are ~0.01,
    where the cap is the identity to 1e-5 and dropping it would go unseen)."""
    import transformers

    model = build(transformers.Gemma2ForCausalLM, transformers.Gemma2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, attn_logit_softcapping=2.0,
        final_logit_softcapping=None, sliding_window=64, query_pre_attn_scalar=8, attn_implementation="eager"))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(20)
            layer.self_attn.k_proj.weight.mul_(20)
    return model


def gpt_oss():  # noqa: ANN201
    """GPT-OSS: per-head attention sinks, a mixture of experts, a sliding-window layer (window >= sequence)."""
    import transformers

    return build(transformers.GptOssForCausalLM, transformers.GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=64, layer_types=["sliding_attention", "full_attention"], attn_implementation="eager"))
