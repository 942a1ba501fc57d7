"""`estimate_memory`: the memory per rank of a strategy before anything runs (ZeRO paper; Korthikanti et al. 2022).

Model states follow the ZeRO paper (Rajbhandari et al. 2020, sections 3-5): with Ψ parameters, N data-parallel ranks
and mixed-precision Adam, 16Ψ (DDP), 4Ψ + 12Ψ/N (ZeRO-1), 2Ψ + 14Ψ/N (ZeRO-2), 16Ψ/N (ZeRO-3); Figure 1 (Ψ = 7.5B,
N = 64) gives 120, 31.4, 16.6 and 1.9 GB. Activations are added when the sequence length and batch are given
(Korthikanti et al., sbh(34 + 5as/h) per layer; with activation checkpointing 2sbh per layer plus one layer being
recomputed). The formulas, their variants (fp32, other optimizers, tensor and pipeline parallel, CPU offload) and
their assumptions live in one place, `shardwise.planner.costs`; this is their user-facing entry point.
"""

from __future__ import annotations

import dataclasses
import math

from torch import nn

from .planner import costs
from .planner.model_facts import model_facts

__all__ = ["MemoryEstimate", "estimate_memory", "STRATEGIES"]

#: strategy names estimate_memory accepts: costs.SHARDED's keys and the strategy strings of sw.distribute.
STRATEGIES = {**{k: k for k in costs.SHARDED}, "fsdp": "full_shard", "fsdp:full_shard": "full_shard",
              "fsdp:shard_grad_op": "shard_grad_op", "fsdp:no_shard": "no_shard", "fsdp:hybrid_shard": "hybrid_shard"}
#: optimizer -> bytes of state per parameter beyond the parameter itself, (mixed precision, fp32)
OPTIMIZER_BYTES = costs.OPTIMIZER_BYTES


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank bytes of one strategy: model states on the device (params, grads, optimizer), bytes offloaded to
    the CPU, and activations (None when the geometry was not given). `total` is what the device holds."""

    strategy: str
    world_size: int
    num_params: int
    params: float
    grads: float
    optimizer: float
    activations: float | None = None
    cpu: float = 0.0

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.model_states + (self.activations or 0.0)

    @property
    def total_gb(self) -> float:
        """Total in GB of 10^9 bytes, the unit of the ZeRO paper."""
        return self.total / 1e9


def _count(model_or_num_params: object) -> int:
    value = model_or_num_params
    if isinstance(value, nn.Module):
        return model_facts(value).num_params
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 1:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"estimate_memory: {value!r} is not a whole number of parameters")
        return int(value)
    raise ValueError(f"estimate_memory: {value!r} is neither a module nor a positive parameter count (e.g. 7e9)")


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"estimate_memory: {name}={value!r} must be a positive int")
    return value


def estimate_memory(
    model_or_num_params: nn.Module | int | float,
    strategy: str = "zero3",
    world_size: int = 1,
    *,
    optimizer: str = "adamw",
    mixed_precision: bool = True,
    seq_len: int | None = None,
    batch_size: int | None = None,
    hidden_size: int | None = None,
    num_layers: int | None = None,
    num_heads: int | None = None,
    vocab_size: int | None = None,
    activation_checkpointing: bool | int = False,
    attention: str = "eager",
    tp: int = 1,
    pp: int = 1,
    sequence_parallel: bool = False,
    cpu_offload: str | None = None,
) -> MemoryEstimate:
    """Bytes per rank of `strategy` over `world_size` ranks (see the module docstring and `planner.costs`).

    model_or_num_params: a module (its unique parameters are counted; a GPT's or HuggingFace config gives the
        geometry) or a parameter count Ψ (int or float: 7e9).
    strategy: one of STRATEGIES ("ddp", "zero1", "zero2", "zero3", "fsdp:shard_grad_op", ...), the data-parallel
        strategy over world_size / (tp x pp) ranks; for "hybrid_shard", world_size is the shard group's size (the
        states are sharded over it and replicated across groups).
    optimizer: one of OPTIMIZER_BYTES ("none": weights and gradients only). mixed_precision: 16-bit parameters and
        gradients with an fp32 master copy in the optimizer state (True), or everything in fp32 (False).
    seq_len, batch_size: give both to add activations (batch_size: sequences per data-parallel rank per step);
        hidden_size, num_layers, num_heads, vocab_size: default to the module's config, else to a GPT-like shape
        derived from Ψ (planner.costs.default_shape); the vocabulary is counted only when known.
    activation_checkpointing: keep only each layer's input (2sbh) and recompute: True for every layer, k for every
        k-th (the engine's `activation_checkpointing=k`). attention: "eager" stores the
        attention scores (the paper's 5as/h term), "fused" (FlashAttention / SDPA) does not.
    tp, pp, sequence_parallel: tensor and pipeline parallel sizes within world_size (Ψ divided by tp x pp).
    cpu_offload: None, "optimizer" (optimizer state and master copy on the CPU) or "full" (everything; zero3).
    """
    psi = _count(model_or_num_params)
    if strategy not in STRATEGIES:
        raise ValueError(f"estimate_memory: strategy={strategy!r} is not known; allowed {sorted(STRATEGIES)}")
    if optimizer not in OPTIMIZER_BYTES:
        raise ValueError(f"estimate_memory: optimizer={optimizer!r} is not known; allowed {sorted(OPTIMIZER_BYTES)}")
    world_size, tp, pp = (_positive(n, v) for n, v in (("world_size", world_size), ("tp", tp), ("pp", pp)))
    if world_size % (tp * pp):
        raise ValueError(f"estimate_memory: tp x pp = {tp} x {pp} = {tp * pp} does not divide world_size="
                         f"{world_size}")
    if cpu_offload not in costs.OFFLOAD_LEVELS:
        raise ValueError(f"estimate_memory: cpu_offload={cpu_offload!r} is not known; allowed {costs.OFFLOAD_LEVELS}")
    key = STRATEGIES[strategy]
    if cpu_offload == "full" and key not in ("zero3", "full_shard", "hybrid_shard"):
        raise ValueError(f"estimate_memory: cpu_offload='full' needs parameters sharded (zero3 / fsdp:full_shard); "
                         f"got strategy={strategy!r}")
    if attention not in costs.ATTENTION:
        raise ValueError(f"estimate_memory: attention={attention!r} is not known; allowed {costs.ATTENTION}")
    dtype = "bf16" if mixed_precision else "fp32"
    dp = world_size // (tp * pp)
    states = costs.model_states(psi, key, dp, dtype=dtype, optimizer=optimizer, model_parallel=tp * pp,
                                offload=cpu_offload)
    activations = None
    if (seq_len is None) != (batch_size is None):
        raise ValueError(f"estimate_memory: activations need both seq_len and batch_size; got seq_len={seq_len!r}, "
                         f"batch_size={batch_size!r}")
    if seq_len is not None:
        geometry = activation_geometry(model_or_num_params, psi, _positive("seq_len", seq_len),
                                       _positive("batch_size", batch_size), hidden_size=hidden_size,
                                       num_layers=num_layers, num_heads=num_heads, vocab_size=vocab_size)
        activations = costs.activation_bytes(geometry, tp=tp, pp=pp, sequence_parallel=sequence_parallel,
                                             checkpointing=activation_checkpointing, attention=attention,
                                             dtype=dtype)
    return MemoryEstimate(strategy=strategy, world_size=world_size, num_params=psi, params=states.params,
                          grads=states.grads, optimizer=states.optimizer, activations=activations, cpu=states.cpu)


def activation_geometry(model: object, psi: float, seq_len: int, batch_size: int, *, hidden_size: int | None = None,
                        num_layers: int | None = None, num_heads: int | None = None,
                        vocab_size: int | None = None) -> costs.Activations:
    """The Activations geometry: explicit values first, then the module's config, then costs.default_shape(psi)."""
    facts = model_facts(model) if isinstance(model, nn.Module) else None
    hidden, layers, heads = costs.default_shape(psi)
    hidden = hidden_size or (facts and facts.hidden_size) or hidden
    layers = num_layers or (facts and facts.num_layers) or layers
    heads = num_heads or (facts and facts.num_heads) or max(1, hidden // 128)
    vocab = vocab_size or (facts and facts.vocab_size) or None
    for name, value in (("hidden_size", hidden), ("num_layers", layers), ("num_heads", heads)):
        _positive(name, value)
    return costs.Activations(seq_len, batch_size, hidden, layers, heads, vocab)
