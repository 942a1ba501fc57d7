"""Expert parallelism: the experts of each mixture-of-experts layer split over ranks, tokens sent to them and back
with all-to-alls (GShard, arXiv 2006.16668; Switch, 2101.03961; DeepSpeed-MoE, 2201.05596; dropless as MegaBlocks,
2211.15841). See docs/experts.md and `parallel.py`.

    model = expert_parallel(GPT(GPTConfig(n_experts=8, experts_per_token=2)), mesh.ep, dp=mesh.dp, edp=mesh.edp)
    model = sw.DDP(model, mesh.dp)     # dense gradients averaged over dp, experts' over edp

HuggingFace MoE models (Mixtral's fused experts and every family whose experts compute the same: Qwen2/3-MoE, OLMoE,
DeepSeek-V3 ... (hf_kinds.py); Switch Transformers' expert modules) go through the same call (hf.py).
"""

from .layer import ExpertGroups, ExpertParallelLayer
from .ops import all_to_all_rows, exchange_counts, sum_over_ranks
from .parallel import EXPERT_TENSORS, expert_parallel

__all__ = ["EXPERT_TENSORS", "ExpertGroups", "ExpertParallelLayer", "all_to_all_rows", "exchange_counts",
           "expert_parallel", "sum_over_ranks"]
