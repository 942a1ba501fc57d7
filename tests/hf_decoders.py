"""Small HuggingFace decoders for the `sw.parallelize` tests: each built from torch.manual_seed(0), so every call
gives the same weights (build them before launching thread ranks, which share torch's RNG); and the one-process run
those tests compare against (`one_process`: AdamW with weight decay, a binding clip, HuggingFace's own loss)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

STEPS, MAX_NORM = 3, 0.05  # the gradient norm of these models is far above 0.05: the clip binds at every step


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-5, weight_decay=0.1)


def one_process(model, batch):
    """(state dict, gradient norms, losses) of STEPS steps of `model` in one process, `batch(step)` giving the
    keywords of its forward and the labels."""
    opt = optimizer(model.parameters())
    norms, losses = [], []
    for step in range(STEPS):
        inputs, labels = batch(step)
        loss = model(**inputs, labels=labels).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
    assert min(norms) > MAX_NORM  # the clip binds at every step
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms, losses


def llama(**extra):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False, attn_implementation="eager", **extra)
    return transformers.LlamaForCausalLM(config)


def mixtral(**extra):
    torch.manual_seed(0)
    config = transformers.MixtralConfig(**{**dict(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
        router_jitter_noise=0.0, output_router_logits=True, router_aux_loss_coef=0.05, attention_dropout=0.0,
        sliding_window=None, tie_word_embeddings=False, pad_token_id=None, bos_token_id=0, eos_token_id=1,
        attn_implementation="eager", experts_implementation="eager"), **extra})
    return transformers.MixtralForCausalLM(config)


def gpt2(**extra):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=64, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager", **extra)
    return transformers.GPT2LMHeadModel(config)


def gemma(**extra):  # its embedding scales its output (a forward of its own: kept whole under tensor parallel)
    torch.manual_seed(0)
    config = transformers.GemmaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=64, attn_implementation="eager", **extra)
    return transformers.GemmaForCausalLM(config)


def qwen3(**extra):  # per-head q_norm / k_norm: partial gradients under tensor parallel
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=64, tie_word_embeddings=False,
                                      attn_implementation="eager", **extra)
    return transformers.Qwen3ForCausalLM(config)


def qwen3_moe(**extra):  # Mixtral's experts and load-balancing loss under another class (experts/hf_kinds.py)
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, output_router_logits=True, router_aux_loss_coef=0.05, tie_word_embeddings=False,
        attn_implementation="eager", **extra)
    return transformers.Qwen3MoeForCausalLM(config)


def qwen2_moe(**extra):  # a sigmoid-gated shared expert beside the routed ones
    torch.manual_seed(0)
    config = transformers.Qwen2MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, output_router_logits=True,
        router_aux_loss_coef=0.05, tie_word_embeddings=False, attn_implementation="eager", **extra)
    return transformers.Qwen2MoeForCausalLM(config)


def gpt_oss(window=8):  # attention sinks, a sliding-window layer, biased experts with a clamped SwiGLU
    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=0.05, sliding_window=window,
        layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False, attn_implementation="eager")
    return transformers.GptOssForCausalLM(config)


def mistral_window():  # a sliding window of 5 < T = 16: under cp=2 it crosses the zigzag chunks (4 tokens each)
    torch.manual_seed(0)
    return transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, sliding_window=5, tie_word_embeddings=False,
        attn_implementation="eager"))


MODELS = {"llama": llama, "mixtral": mixtral, "gpt2": gpt2, "gemma": gemma, "qwen3": qwen3, "qwen3_moe": qwen3_moe,
          "qwen2_moe": qwen2_moe, "gpt_oss": gpt_oss, "mistral_window": mistral_window}
