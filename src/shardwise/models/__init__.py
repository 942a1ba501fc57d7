"""Models used by the demo, the tests and the benchmarks."""

from shardwise.models.gpt import GPT, GPTConfig, lm_loss

__all__ = ["GPT", "GPTConfig", "lm_loss"]
