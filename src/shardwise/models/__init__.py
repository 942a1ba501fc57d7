"""Models used by the demo, the tests and the benchmarks."""

from shardwise.models.gpt import GPT, GPTConfig, lm_loss
from shardwise.models.hf_gpt2_stages import gpt2_pipeline_layers
from shardwise.models.hf_stages import causal_lm_loss, llama_pipeline_layers

__all__ = ["GPT", "GPTConfig", "causal_lm_loss", "gpt2_pipeline_layers", "llama_pipeline_layers", "lm_loss"]
