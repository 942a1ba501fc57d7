"""Check HuggingFace decoders under context parallel on packed rows, each against one process, with `sw.check`.

    python examples/check_packed_context_parallel.py                   # the decoders below, ring and Ulysses
    python examples/check_packed_context_parallel.py llama qwen3_moe   # some of them

Each model is built tiny from its `model_type` (2 layers, width 32, 4 experts where it has experts, no dropout or
router noise, eager attention) and trained 2 AdamW steps at cp = 2 on rows of packed documents: `position_ids`
restart at each document, as `DataCollatorWithFlattening` gives them, and `use_cache=False`, with which transformers'
eager attention keeps the documents apart in one process. One line per model and method: OK, the check's report when
it differs, or the error a strategy raised. OPT's and GPT-OSS's eager masks ignore packed positions in one process
(docs/context_parallel.md, "Packed sequences"), so those two differ by design.
"""

from __future__ import annotations

import sys
import threading

import torch

import shardwise as sw

DECODERS = ("llama mistral qwen2 qwen3 gemma gemma2 gemma3_text phi phi3 olmo olmo2 olmo3 cohere granite starcoder2 "
            "mixtral qwen2_moe qwen3_moe phimoe smollm3 gpt_neox stablelm ernie4_5 hunyuan_v1_dense arcee apertus "
            "exaone4 seed_oss").split()
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, moe_intermediate_size=32, num_experts=4,
            num_local_experts=4, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            attention_dropout=0.0, residual_dropout=0.0, router_jitter_noise=0.0, input_jitter_noise=0.0,
            sliding_window=6)
_BUILD = threading.Lock()  # thread ranks share torch's global generator
IDS = torch.randint(3, 64, (4, 16), generator=torch.Generator().manual_seed(3))
POSITIONS = torch.tensor([[*range(5), *range(7), *range(4)], [*range(9), *range(7)], [*range(16)],
                          [*range(3), *range(13)]])


def packed_batch(step: int) -> dict:
    return {"input_ids": IDS, "labels": IDS, "position_ids": POSITIONS, "use_cache": False}


def builder(model_type: str):  # noqa: ANN201
    from transformers import AutoConfig, AutoModelForCausalLM

    def build():  # noqa: ANN202
        config = AutoConfig.for_model(model_type, **TINY)
        config._attn_implementation = "eager"
        with _BUILD, torch.random.fork_rng():
            torch.manual_seed(0)
            return AutoModelForCausalLM.from_config(config)

    return build


def main(model_types: list[str]) -> None:
    for model_type in model_types:
        for method in ("ring", "ulysses"):
            try:
                report = sw.check(builder(model_type), packed_batch, strategy={"cp": 2, "cp_method": method},
                                  world_size=2, steps=2)
                print(model_type, method, "OK" if report.ok else f"DIFFERS\n{report}", flush=True)
            except Exception as exc:  # noqa: BLE001 - a strategy's refusal is a result here
                print(model_type, method, f"{type(exc).__name__}: {exc}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or DECODERS)
