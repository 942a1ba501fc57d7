"""The textbook per-rank wire bytes of each data-parallel strategy, in the vocabulary of `shardwise demo` and
`shardwise bench`, for tables that put a measured figure beside its formula.

The formulas themselves live in one place, `shardwise.planner.costs` (ring collectives; the ZeRO paper's section
7): with G the gradient bytes and N the data-parallel ranks, DDP, ZeRO-1, ZeRO-2 and shard_grad_op send
2(N-1)/N x G per rank per step, ZeRO-3 / full_shard 3(N-1)/N x G (the parameters are gathered in forward and again
in backward), hybrid_shard 3(S-1)/S x G inside its shard groups of S plus an all-reduce of the G/S shard across the
R = N/S groups. This module maps strategy strings to the planner's names and writes the formula as text, and
counts M microbatches per step (gradient accumulation, or a pipeline's microbatches): the gradients are still
reduced once per step, but ZeRO-3 / full_shard / hybrid_shard gather every unit in forward and backward of each
microbatch, 2M gathers instead of 2: (2M+1)(N-1)/N x G; shard_grad_op keeps the gathered parameters from forward
through backward, so gathers once per microbatch: (M+1)(N-1)/N x G.
shardwise's ZeRO-3 keeps the root unit and the last forward unit gathered from forward into backward (they run first
in backward), so it measures a little under its formula; padding to a multiple of N can add a few bytes.
"""

from __future__ import annotations

from ..planner.costs import data_parallel_wire_bytes

__all__ = ["ESTIMATE_KEY", "wire_bytes_formula", "formula_text", "estimate_key"]

#: Strategy strings (the demo's, the benchmark's; "none" = no communication) -> the planner's and
#: `sw.estimate_memory`'s strategy names.
ESTIMATE_KEY = {"none": "ddp", "ddp": "ddp", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3",
                "fsdp:no_shard": "no_shard", "fsdp:shard_grad_op": "shard_grad_op", "fsdp:full_shard": "full_shard",
                "fsdp:hybrid_shard": "hybrid_shard"}
_TEXT = {"ddp": "2(N-1)/N x G", "no_shard": "2(N-1)/N x G", "zero1": "2(N-1)/N x G", "zero2": "2(N-1)/N x G",
         "shard_grad_op": "2(N-1)/N x G", "zero3": "3(N-1)/N x G", "full_shard": "3(N-1)/N x G",
         "hybrid_shard": "3(S-1)/S x G + 2(R-1)/R x G/S"}


def estimate_key(strategy: str) -> str:
    """The name the planner and `sw.estimate_memory` know `strategy` by; ValueError naming the allowed ones."""
    if strategy not in ESTIMATE_KEY:
        raise ValueError(f"strategy={strategy!r} has no formula; allowed {sorted(ESTIMATE_KEY)}")
    return ESTIMATE_KEY[strategy]


def wire_bytes_formula(strategy: str, grad_bytes: int, world_size: int, shard_size: int | None = None,
                       microbatches: int = 1) -> int:
    """Per-rank wire bytes of one step of `strategy` over `world_size` data-parallel ranks whose gradients take
    `grad_bytes` (fp32: 4 per parameter); `shard_size` is the shard-group size of "fsdp:hybrid_shard";
    `microbatches` per step (see the module docstring)."""
    key = estimate_key(strategy)
    if strategy == "none":
        return 0
    if key == "hybrid_shard" and (shard_size is None or shard_size < 1 or world_size % shard_size):
        raise ValueError(f"fsdp:hybrid_shard needs shard_size, a divisor of world_size={world_size}; "
                         f"got {shard_size!r}")
    by_group = data_parallel_wire_bytes(grad_bytes / 4, key, world_size, dtype="fp32", shard=shard_size)
    extra = 0.0
    if key in ("zero3", "full_shard", "hybrid_shard") and microbatches > 1:
        group = shard_size if key == "hybrid_shard" else world_size
        extra = 2 * (microbatches - 1) * (group - 1) / group * grad_bytes  # the gathers of the other microbatches
    elif key == "shard_grad_op" and microbatches > 1:
        extra = (microbatches - 1) * (world_size - 1) / world_size * grad_bytes
    return round(sum(by_group.values()) + extra)


def formula_text(strategy: str, microbatches: int = 1) -> str:
    """The formula as a short text for tables: "2(N-1)/N x G", ..."""
    key = estimate_key(strategy)
    if strategy == "none":
        return "0 (no communication)"
    if key in ("zero3", "full_shard", "hybrid_shard") and microbatches > 1:
        inner = "(S-1)/S" if key == "hybrid_shard" else "(N-1)/N"
        rest = " + 2(R-1)/R x G/S" if key == "hybrid_shard" else ""
        return f"(2M+1){inner} x G{rest}, M={microbatches}"
    if key == "shard_grad_op" and microbatches > 1:
        return f"(M+1)(N-1)/N x G, M={microbatches}"
    return _TEXT[key]
