"""Context parallelism: one sequence's tokens split over a group of ranks, attention computed exactly across them.

Activations grow with sequence length; tensor and sequence parallelism split them only by the tensor-parallel size
and pipeline parallelism not at all. Context parallelism gives each of cp ranks T/cp tokens of every sequence in
every layer, so activation memory per rank falls ~cp-fold; only attention sees other ranks' tokens:

* ring attention (ring.py; Liu et al. 2023, arXiv 2310.01889): key/value blocks pass around the ring with
  point-to-point transfers overlapped with each block's attention, partial results merged by log-sum-exp; the
  backward is a ring too. Any head count.
* all-to-all attention (ulysses.py; DeepSpeed Ulysses, Jacobs et al. 2023, arXiv 2309.14509): q, k, v re-split from
  tokens to heads, local full attention, and back. Heads divisible by cp.
* zigzag split (split.py; Striped Attention, Brandon et al. 2023, arXiv 2311.09431, in Megatron / torchtitan's
  two-chunk form): rank r holds chunks r and 2cp-1-r so causal work is balanced.

Usage (see docs/context_parallel.md)::

    from shardwise import context_parallel as cp
    model = sw.DDP(cp.apply(GPT(config, seed=0), comm, method="ring"), comm)
    x_r, y_r = cp.split_sequence((x, y), comm)
    model(x_r, y_r).backward()      # parameters step as one process on (x, y)
"""

from .apply import METHODS, ContextParallelState, apply
from .ring import RingAttention, ring_attention
from .split import SequenceSplit, gather_sequence, sequence_positions, split_sequence
from .ulysses import AllToAll, ulysses_attention

__all__ = [
    "AllToAll",
    "ContextParallelState",
    "METHODS",
    "RingAttention",
    "SequenceSplit",
    "apply",
    "gather_sequence",
    "ring_attention",
    "sequence_positions",
    "split_sequence",
    "ulysses_attention",
]
