"""`estimate_memory`: the memory per rank of a strategy before anything runs (ZeRO paper; Korthikanti et al. 2022).

Model states follow the ZeRO paper (Rajbhandari et al. 2020, sections 3-5): with Ψ parameters, N data-parallel ranks
and mixed-precision Adam, 16Ψ (DDP), 4Ψ + 12Ψ/N (ZeRO-1), 2Ψ + 14Ψ/N (ZeRO-2), 16Ψ/N (ZeRO-3); Figure 1 (Ψ = 7.5B,
N = 64) gives 120, 31.4, 16.6 and 1.9 GB. Activations are added when the sequence length and batch are given
(Korthikanti et al., sbh(34 + 5as/h) per layer; with activation checkpointing 2sbh per layer plus one layer being
recomputed). Context parallel (cp) divides the activations by cp: each rank holds T/cp tokens of every sequence.
Expert parallel (ep) divides the parameters, gradients and optimizer state of a mixture of experts' experts by ep,
then the strategy shards them over the dp x cp / ep ranks holding the same experts (the dense ones over dp x cp),
and adds the all-to-all bytes of the token exchange; tensor parallel divides the dense parameters, not the experts.
The formulas, their variants (fp32, other optimizers, tensor, pipeline, context and expert parallel, CPU offload)
and their assumptions live in one place, `shardwise.planner.costs`; this is their user-facing entry point.
"""

from __future__ import annotations

import dataclasses
import math

from torch import nn

from .planner import costs
from .planner.model_facts import model_facts

__all__ = ["MemoryEstimate", "estimate_memory", "STRATEGIES", "format_bytes"]

#: strategy names estimate_memory accepts: costs.SHARDED's keys and the strategy strings of sw.distribute.
STRATEGIES = {**{k: k for k in costs.SHARDED}, "fsdp": "full_shard", "fsdp:full_shard": "full_shard",
              "fsdp:shard_grad_op": "shard_grad_op", "fsdp:no_shard": "no_shard", "fsdp:hybrid_shard": "hybrid_shard"}
#: optimizer -> bytes of state per parameter beyond the parameter itself, (mixed precision, fp32)
OPTIMIZER_BYTES = costs.OPTIMIZER_BYTES


def format_bytes(n: float | None) -> str:
    """Bytes in decimal units, three significant figures or more: "512 B", "59.3 kB", "1.88 GB" (None: "-")."""
    if n is None:
        return "-"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{n:.0f} B"


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank bytes of one strategy: model states on the device (params, grads, optimizer), bytes offloaded to
    the CPU, and activations (None when the geometry was not given). `total` is what the device holds.

    cp, ep: the context- and expert-parallel sizes estimated; expert_params: the parameters inside experts (0: a
    dense model, or not given); all_to_all: bytes one rank sends per step in the expert-parallel all-to-alls
    (uniform routing; None unless ep > 1 and the geometry, n_experts and experts_per_token are known). The fields
    hold raw bytes; repr() and str() print them in kB / MB / GB.
    """

    strategy: str
    world_size: int
    num_params: int
    params: float
    grads: float
    optimizer: float
    activations: float | None = None
    cpu: float = 0.0
    cp: int = 1
    ep: int = 1
    expert_params: int = 0
    all_to_all: float | None = None

    def __repr__(self) -> str:
        sizes = ", ".join(f"{name}={'None' if getattr(self, name) is None else format_bytes(getattr(self, name))}"
                          for name in ("params", "grads", "optimizer", "activations", "cpu"))
        extra = "".join(f", {name}={getattr(self, name)}" for name in ("cp", "ep") if getattr(self, name) > 1)
        if self.expert_params:
            extra += f", expert_params={self.expert_params:,}"
        if self.all_to_all is not None:
            extra += f", all_to_all={format_bytes(self.all_to_all)}"
        return (f"MemoryEstimate(strategy={self.strategy!r}, world_size={self.world_size}, "
                f"num_params={self.num_params:,}{extra}, {sizes}, total={format_bytes(self.total)})")

    __str__ = __repr__

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


def _count(model_or_num_params: object, name: str | None = None) -> int:
    value = model_or_num_params
    if isinstance(value, nn.Module) and name is None:
        return model_facts(value).num_params
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 1:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"estimate_memory: {f'{name}=' if name else ''}{value!r} is not a whole number of "
                             f"parameters")
        return int(value)
    if name:
        raise ValueError(f"estimate_memory: {name}={value!r} must be a positive parameter count (e.g. 4e9)")
    raise ValueError(f"estimate_memory: {value!r} is neither a module nor a positive parameter count (e.g. 7e9)")


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"estimate_memory: {name}={value!r} must be a positive int")
    return value


def _experts(model: object, expert_params: object, n_experts: object,
             experts_per_token: object) -> costs.Experts | None:
    """The model's experts: from a module's MoE layers, else from the counts given (None: a dense model)."""
    given = {"expert_params": expert_params, "n_experts": n_experts, "experts_per_token": experts_per_token}
    if isinstance(model, nn.Module):
        named = [k for k, v in given.items() if v is not None]
        if named:
            raise ValueError(f"estimate_memory: {', '.join(named)} is read from the module's MoE layers; give it "
                             f"only with a parameter count")
        facts = model_facts(model)
        if not facts.expert_params:
            return None
        return costs.Experts(facts.expert_params, facts.n_experts, facts.experts_per_token, facts.moe_layers)
    if expert_params is None:
        if n_experts is not None or experts_per_token is not None:
            raise ValueError("estimate_memory: n_experts and experts_per_token describe the experts of "
                             "expert_params=; give expert_params (the parameters inside the experts) too")
        return None
    try:
        return costs.Experts(_count(expert_params, "expert_params"), n_experts or 0, experts_per_token or 0)
    except ValueError as exc:
        raise ValueError(f"estimate_memory: {exc}") from None


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
    cp: int = 1,
    ep: int = 1,
    expert_params: int | float | None = None,
    n_experts: int | None = None,
    experts_per_token: int | None = None,
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
    tp, pp, sequence_parallel: tensor and pipeline parallel sizes within world_size (Ψ divided by tp x pp; the
        experts of a mixture of experts by pp only).
    cpu_offload: None, "optimizer" (optimizer state and master copy on the CPU) or "full" (everything; zero3).
    cp: context-parallel ranks within world_size (world_size = dp x cp x tp x pp): each holds seq_len / cp tokens of
        every sequence, so the activations are divided by cp (batch_size stays the sequences of its dp replica);
        the dense states are shared by the strategy over the dp x cp ranks, as without cp.
    ep: expert-parallel ranks, borrowed from dp x cp (ep must divide it): each rank holds 1/ep of the experts, their
        states sharded by `strategy` over the edp = dp x cp / ep ranks holding the same experts; the dense ones
        follow `strategy` over dp x cp (ep > 1 refuses "hybrid_shard", whose shard groups cut across edp). With tp,
        the experts are replicated over the tensor-parallel ranks (the "gpt" plan keeps each MoE layer whole), so
        tp divides the dense parameters only, with any ep.
    expert_params, n_experts, experts_per_token: with a parameter count, the parameters inside the experts (of
        every MoE layer, all experts; routers excluded), E and k; a module's MoE layers give them. E and k size the
        all-to-all bytes (`all_to_all`, with seq_len and batch_size; every layer is taken to be MoE).
    """
    psi = _count(model_or_num_params)
    if strategy not in STRATEGIES:
        raise ValueError(f"estimate_memory: strategy={strategy!r} is not known; allowed {sorted(STRATEGIES)}")
    if optimizer not in OPTIMIZER_BYTES:
        raise ValueError(f"estimate_memory: optimizer={optimizer!r} is not known; allowed {sorted(OPTIMIZER_BYTES)}")
    world_size, tp, pp, cp, ep = (_positive(n, v) for n, v in (("world_size", world_size), ("tp", tp), ("pp", pp),
                                                                ("cp", cp), ("ep", ep)))
    if world_size % (cp * tp * pp):
        what = f"cp x tp x pp = {cp} x {tp} x {pp} = {cp * tp * pp}" if cp > 1 else f"tp x pp = {tp} x {pp} = {tp * pp}"
        raise ValueError(f"estimate_memory: {what} does not divide world_size={world_size}")
    experts = _experts(model_or_num_params, expert_params, n_experts, experts_per_token)
    if experts is not None and experts.params > psi:
        raise ValueError(f"estimate_memory: expert_params={experts.params:,} exceeds the {psi:,} parameters")
    data_ranks = world_size // (tp * pp)  # dp x cp: the ranks dense gradients average over
    if ep > 1:
        if experts is None:
            raise ValueError(f"estimate_memory: ep={ep} splits the experts of a mixture of experts; give a module "
                             f"with MoE layers, or expert_params= with the parameter count")
        if data_ranks % ep:
            raise ValueError(f"estimate_memory: ep={ep} must divide dp x cp = {data_ranks} (expert parallel borrows "
                             f"its ranks from the data- and context-parallel ones)")
        if experts.n_experts and experts.n_experts % ep:
            raise ValueError(f"estimate_memory: ep={ep} must divide n_experts={experts.n_experts}")
        if STRATEGIES[strategy] == "hybrid_shard":
            allowed = sorted(k for k in STRATEGIES if STRATEGIES[k] != "hybrid_shard")
            raise ValueError(f"estimate_memory: ep={ep} with strategy={strategy!r} is not supported (its shard groups "
                             f"cut across the ranks holding the same experts, edp); allowed {allowed}")
    if cpu_offload not in costs.OFFLOAD_LEVELS:
        raise ValueError(f"estimate_memory: cpu_offload={cpu_offload!r} is not known; allowed {costs.OFFLOAD_LEVELS}")
    key = STRATEGIES[strategy]
    if cpu_offload == "full" and key not in ("zero3", "full_shard", "hybrid_shard"):
        raise ValueError(f"estimate_memory: cpu_offload='full' needs parameters sharded (zero3 / fsdp:full_shard); "
                         f"got strategy={strategy!r}")
    if attention not in costs.ATTENTION:
        raise ValueError(f"estimate_memory: attention={attention!r} is not known; allowed {costs.ATTENTION}")
    dtype = "bf16" if mixed_precision else "fp32"
    states = costs.model_states(psi, key, data_ranks, dtype=dtype, optimizer=optimizer, model_parallel=tp * pp,
                                offload=cpu_offload, expert_params=experts.params if experts else 0.0, ep=ep, tp=tp)
    activations = all_to_all = None
    if (seq_len is None) != (batch_size is None):
        raise ValueError(f"estimate_memory: activations need both seq_len and batch_size; got seq_len={seq_len!r}, "
                         f"batch_size={batch_size!r}")
    if seq_len is not None:
        geometry = activation_geometry(model_or_num_params, psi, _positive("seq_len", seq_len),
                                       _positive("batch_size", batch_size), hidden_size=hidden_size,
                                       num_layers=num_layers, num_heads=num_heads, vocab_size=vocab_size)
        activations = costs.activation_bytes(geometry, tp=tp, pp=pp, sequence_parallel=sequence_parallel,
                                             checkpointing=activation_checkpointing, attention=attention,
                                             dtype=dtype, cp=cp)
        if ep > 1 and experts is not None and experts.n_experts and experts.per_token:
            all_to_all = costs.expert_parallel_wire_bytes(geometry, experts, ep, cp=cp, pp=pp, dtype=dtype,
                                                          sp=tp if sequence_parallel else 1)
    return MemoryEstimate(strategy=strategy, world_size=world_size, num_params=psi, params=states.params,
                          grads=states.grads, optimizer=states.optimizer, activations=activations, cpu=states.cpu,
                          cp=cp, ep=ep, expert_params=int(experts.params) if experts else 0, all_to_all=all_to_all)


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
