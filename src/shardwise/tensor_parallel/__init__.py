"""Tensor and sequence parallelism, Megatron style (Shoeybi et al. 2019; Korthikanti et al. 2022).

    from shardwise import tensor_parallel as tp
    model = tp.parallelize(GPT(config, seed=0), mesh.tp, plan="gpt", sequence_parallel=True)
    loss = model(x, y); loss.backward(); opt.step()        # every tp rank feeds the same batch
    state = tp.full_state_dict(model)                      # original names and shapes (collective)

Files: `mappings.py` (the differentiable collectives f, g, gather/scatter and the sequence-parallel pair),
`layers.py` (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding), `cross_entropy.py`
(vocab_parallel_cross_entropy), `sequence_parallel.py` (gradient hooks of replicated parameters, activation
memory measurement), `plans.py` (styles, built-in plans), `parallelize.py`, `gpt.py` (the GPT's parallel forward),
`hf_gpt2.py` (HuggingFace GPT-2: Conv1D layers, per-rank attention sizes).
See docs/tensor_parallel.md.
"""

from .cross_entropy import vocab_parallel_cross_entropy
from .layers import ColumnParallelLinear, RowParallelLinear, TensorParallelLayer, VocabParallelEmbedding
from .mappings import (
    copy_to_region,
    gather_from_region,
    gather_from_sequence_region,
    reduce_from_region,
    reduce_scatter_to_sequence_region,
    scatter_to_region,
    scatter_to_sequence_region,
)
from .parallelize import TensorParallelState, full_state_dict, parallelize
from .plans import BUILTIN_PLANS, Colwise, HeadRows, Heads, Rowwise, Sequence, SplitNorm, Vocab
from .sequence_parallel import (
    SavedActivations,
    is_sequence_parallel_param,
    reduce_sequence_parallel_grads,
    saved_activations,
)
from .split_norm import SplitRMSNorm

__all__ = [
    "BUILTIN_PLANS",
    "Colwise",
    "ColumnParallelLinear",
    "HeadRows",
    "Heads",
    "Rowwise",
    "RowParallelLinear",
    "SavedActivations",
    "Sequence",
    "SplitNorm",
    "SplitRMSNorm",
    "TensorParallelLayer",
    "TensorParallelState",
    "Vocab",
    "VocabParallelEmbedding",
    "copy_to_region",
    "full_state_dict",
    "gather_from_region",
    "gather_from_sequence_region",
    "is_sequence_parallel_param",
    "parallelize",
    "reduce_from_region",
    "reduce_scatter_to_sequence_region",
    "reduce_sequence_parallel_grads",
    "saved_activations",
    "scatter_to_region",
    "scatter_to_sequence_region",
    "vocab_parallel_cross_entropy",
]
