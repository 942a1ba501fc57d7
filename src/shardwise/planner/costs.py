"""Memory per rank and bytes on the wire per step, by strategy: the one source of the planner's formulas.

**Model states** (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC 2020,
sections 3 and 5). With Ψ parameters, N ranks sharing the states and mixed-precision Adam: 16-bit parameters (2Ψ
bytes) and gradients (2Ψ), and K = 12 bytes of optimizer state per parameter (fp32 master copy, momentum, variance):

    DDP / no_shard            (2 + 2 + K) Ψ            = 16Ψ
    ZeRO-1 (P_os)             2Ψ + 2Ψ + KΨ/N           = 4Ψ + 12Ψ/N
    ZeRO-2 (P_os+g)           2Ψ + (2 + K)Ψ/N          = 2Ψ + 14Ψ/N
    ZeRO-3 / full_shard       (2 + 2 + K)Ψ/N           = 16Ψ/N

Figure 1 of the paper (Ψ = 7.5B, N = 64) gives 120, 31.4, 16.6 and 1.9 GB. In fp32 (no mixed precision) parameters
and gradients take 4 bytes and Adam K = 8 (the parameters are their own master copy); `OPTIMIZER_BYTES` holds K
for other optimizers ("none": weights and gradients only, the convention of tables that quote 4 bytes/parameter).
FSDP's shard_grad_op keeps the parameters sharded at rest but gathered from forward through backward, so its peak is
ZeRO-2's. hybrid_shard is full_shard within groups of `shard` ranks (N = shard). Tensor parallel (t) and pipeline
parallel (p) first divide Ψ by t x p (embeddings split too: Megatron's vocabulary-parallel embedding); the
data-parallel strategy then divides what is left over its dp ranks.

**CPU offload** (Ren et al., "ZeRO-Offload", USENIX ATC 2021; Rajbhandari et al., "ZeRO-Infinity", SC 2021):
level "optimizer" keeps the fp32 master shard, its fp32 gradient shard and the optimizer state on the CPU (the
optimizer steps there): (4 + 4 + S)Ψ/N bytes, S the optimizer state without the master copy (Adam 8), 16Ψ/N for
Adam whatever the training dtype. The device keeps the compute parameters (whole for ZeRO-1/2, a shard for ZeRO-3:
the paper's device-resident fp16 partition) and, for ZeRO-1 only, the whole gradient buffer (its gradients are not
sharded); reduced gradient shards go straight to the host, as in ZeRO-Offload. Level "full" also keeps the
parameters on the CPU (ZeRO-3 only: FSDP's `CPUOffload(offload_params=True)`), so the device holds only the units
being computed; the host holds the same 16Ψ/N. Offloaded bytes are reported as CPU memory per rank. These are the
bytes `sw.memory_stats(model, opt).host` and `.device_model_states` measure (bench/engine_memory.py).

**Activations** (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022, eq. 1-2,
section 4): one transformer layer, sequence s, micro-batch b, hidden h, a heads, 16-bit activations and 1-byte
dropout masks, stores sbh(34 + 5as/h) bytes. Tensor parallel t without sequence parallel: sbh(10 + 24/t + 5as/(ht));
with sequence parallel: sbh(34/t + 5as/(ht)). The 5as/h term is the attention score matrix, which fused attention
kernels (FlashAttention, torch's scaled_dot_product_attention) do not store (`attention="fused"` drops it).
Full activation checkpointing stores each layer's input (2sbh, /t under sequence parallel) and recomputes one layer
at a time during backward (one layer's full activations on top). The 1F1B pipeline schedule keeps p microbatches
in flight on its first stage, each with L/p layers: about L layers' worth, as without a pipeline (paper, section
4.2.3). fp32 activations count twice the bytes. Logits are added when the vocabulary size is known: 4sbV/t bytes
(fp32 logits for the loss).

**Bytes on the wire** per rank per step, ring collectives (Patarasuk & Yuan 2009; the ZeRO paper's section 7):
all-reduce of B bytes over n ranks moves 2(n-1)/n B, reduce-scatter and all-gather (n-1)/n B each. DDP, ZeRO-1,
ZeRO-2 and shard_grad_op: 2(N-1)/N x gradient bytes; ZeRO-3 / full_shard: 3(N-1)/N (the parameter all-gather runs
in forward and again in backward); hybrid_shard: 3(g-1)/g within a group of g plus an all-reduce of the 1/g shard
across the N/g groups. Tensor parallel (Megatron): per layer 4 all-reduces of the sbh activations (2 in forward, 2
in backward), the same bytes as all-gather + reduce-scatter under sequence parallel. Pipeline: each stage boundary
sends an activation (sbh) forward and its gradient back per microbatch.
"""

from __future__ import annotations

import dataclasses
import math

__all__ = ["SHARDED", "OPTIMIZER_BYTES", "DTYPE_BYTES", "OFFLOAD_LEVELS", "ATTENTION", "ModelStates", "Activations",
           "model_states", "activation_bytes", "data_parallel_wire_bytes", "tensor_parallel_wire_bytes",
           "pipeline_wire_bytes", "default_shape"]

#: strategy -> which of (parameters, gradients, optimizer state) are divided by the data-parallel ranks.
SHARDED = {
    "ddp": (False, False, False),
    "no_shard": (False, False, False),
    "zero1": (False, False, True),
    "zero2": (False, True, True),
    "shard_grad_op": (False, True, True),
    "zero3": (True, True, True),
    "full_shard": (True, True, True),
    "hybrid_shard": (True, True, True),  # over the shard group
}
#: optimizer -> bytes of state per parameter beyond the parameter itself: (mixed precision, fp32). With mixed
#: precision the fp32 master copy (4) is part of it: Adam 4 + 4 + 4, SGD with momentum 4 + 4, SGD 4.
OPTIMIZER_BYTES = {"adamw": (12, 8), "adam": (12, 8), "sgd_momentum": (8, 4), "sgd": (4, 0), "none": (0, 0)}
#: training dtype -> bytes of a parameter / gradient / activation element; bf16 and fp16 mean mixed precision.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
#: CPU offload levels: None (nothing), "optimizer" (master copy + optimizer state), "full" (everything; ZeRO-3).
OFFLOAD_LEVELS = (None, "optimizer", "full")
#: how attention stores its scores: "eager" (the a x s x s matrix, the paper's 5as/h term) or "fused" (not stored).
ATTENTION = ("eager", "fused")


@dataclasses.dataclass(frozen=True)
class ModelStates:
    """Bytes of model states one rank holds: on its device (params, grads, optimizer) and offloaded to the CPU."""

    params: float
    grads: float
    optimizer: float
    cpu: float = 0.0

    @property
    def device(self) -> float:
        return self.params + self.grads + self.optimizer


def model_states(psi: float, strategy: str, dp: int, *, dtype: str = "bf16", optimizer: str = "adamw",
                 model_parallel: int = 1, offload: str | None = None, shard: int | None = None) -> ModelStates:
    """Model-state bytes per rank (see the module docstring).

    psi: parameters of the whole model; strategy: a key of SHARDED; dp: data-parallel ranks; model_parallel: t x p,
    the ranks that split the model before data parallel; shard: the shard-group size of hybrid_shard (default dp).
    """
    width = DTYPE_BYTES[dtype]
    k = OPTIMIZER_BYTES[optimizer][0 if width == 2 else 1]
    psi = psi / model_parallel
    shard_p, shard_g, shard_o = SHARDED[strategy]
    n = (shard or dp) if strategy == "hybrid_shard" else dp
    params = width * psi / (n if shard_p else 1)
    grads = width * psi / (n if shard_g else 1)
    state = k * psi / (n if shard_o else 1)
    if offload is None:
        return ModelStates(params, grads, state)
    if offload not in OFFLOAD_LEVELS:
        raise ValueError(f"offload={offload!r} is not known; allowed {OFFLOAD_LEVELS}")
    # On the host: fp32 master shard (4), fp32 gradient shard (4), optimizer state without the master copy.
    state_without_master = k - 4 if width == 2 and k else k
    host = (8 + state_without_master) * psi / n
    kept_grads = 0.0 if shard_g else grads  # ZeRO-1's whole gradient buffer stays on the device
    if offload == "full" and shard_p:
        return ModelStates(0.0, 0.0, 0.0, cpu=host)
    # "optimizer" (and "full" for ZeRO-1/2, which compute with whole parameters: sharding.offload).
    return ModelStates(params, kept_grads, 0.0, cpu=host)


@dataclasses.dataclass(frozen=True)
class Activations:
    """The activation geometry of a transformer: sequence s, micro-batch b (sequences per rank per microbatch),
    hidden h, layers L, heads a, and optionally the vocabulary V."""

    seq_len: int
    batch_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int | None = None


def default_shape(psi: float) -> tuple[int, int, int]:
    """(hidden, layers, heads) of a GPT-like model of `psi` parameters when only the count is known.

    Assumes psi = 12 L h^2 (attention 4h^2 + MLP 8h^2 per layer, embeddings neglected) and the aspect ratio of the
    GPT-3 / Llama families, h = 128 L (7B: 32 x 4096; 13B: 40 x 5120; 175B: 96 x 12288), with head dimension 128.
    """
    layers = max(1, round((psi / (12 * 128 ** 2)) ** (1 / 3)))
    hidden = max(128, 128 * round(math.sqrt(psi / (12 * layers)) / 128))
    return hidden, layers, hidden // 128


def _per_layer(g: Activations, tp: int, sequence_parallel: bool, attention: str) -> float:
    s, b, h, a = g.seq_len, g.batch_size, g.hidden_size, g.num_heads
    scores = 5 * a * s / h if attention == "eager" else 0.0
    if tp == 1 or sequence_parallel:
        return s * b * h * (34 / tp + scores / tp)
    return s * b * h * (10 + 24 / tp + scores / tp)


def activation_bytes(g: Activations, *, tp: int = 1, pp: int = 1, n_microbatches: int | None = None,
                     sequence_parallel: bool = False, checkpointing: bool | int = False, attention: str = "eager",
                     dtype: str = "bf16") -> float:
    """Peak activation bytes on one rank for one step (see the module docstring for the assumptions).

    g.batch_size is this rank's batch per step; a pipeline of pp stages splits it into n_microbatches (default 2 x
    pp) and its first stage holds min(pp, n_microbatches) microbatches of L/pp layers. checkpointing: True (every
    layer), False, or k: every k-th layer (the k-th, 2k-th, ...: floor(L/k) of them, `activation_checkpointing.
    every_kth`) keeps only its input; the others keep everything.
    """
    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r} is not known; allowed {ATTENTION}")
    m = n_microbatches or (2 * pp if pp > 1 else 1)
    micro = dataclasses.replace(g, batch_size=max(1, g.batch_size // m)) if pp > 1 else g
    in_flight = min(pp, m) if pp > 1 else 1
    layers_here = g.num_layers / pp
    per_layer = _per_layer(micro, tp, sequence_parallel, attention)
    interval = 1 if checkpointing is True else int(checkpointing)  # False -> 0
    if interval < 0:
        raise ValueError(f"checkpointing={checkpointing!r} must be True, False or a positive int (every k-th layer)")
    if interval:
        stored = 2 * micro.seq_len * micro.batch_size * micro.hidden_size / (tp if sequence_parallel else 1)
        checkpointed = layers_here // interval if interval > 1 else layers_here
        total = in_flight * (checkpointed * stored + (layers_here - checkpointed) * per_layer)
        total += per_layer  # + one layer recomputed at a time
    else:
        total = in_flight * layers_here * per_layer
    if g.vocab_size:
        total += 4 * micro.seq_len * micro.batch_size * g.vocab_size / tp
    return total * DTYPE_BYTES[dtype] / 2


def _ring(kind: str, nbytes: float, n: int) -> float:
    if n <= 1:
        return 0.0
    factor = 2 if kind == "all_reduce" else 1
    return factor * (n - 1) / n * nbytes


def data_parallel_wire_bytes(psi: float, strategy: str, dp: int, *, dtype: str = "bf16", model_parallel: int = 1,
                             shard: int | None = None) -> dict[str, float]:
    """Bytes one rank sends per step for the data-parallel strategy, by group: {"dp": ...} or, for hybrid_shard,
    {"shard": within the group, "replicate": across the groups}. Gradients travel in the training dtype."""
    nbytes = DTYPE_BYTES[dtype] * psi / model_parallel
    if strategy in ("ddp", "no_shard"):
        return {"dp": _ring("all_reduce", nbytes, dp)}
    if strategy in ("zero1", "zero2", "shard_grad_op"):  # reduce-scatter gradients + all-gather parameters
        return {"dp": _ring("reduce_scatter", nbytes, dp) + _ring("all_gather", nbytes, dp)}
    if strategy in ("zero3", "full_shard"):  # + the parameters gathered again in backward
        return {"dp": _ring("reduce_scatter", nbytes, dp) + 2 * _ring("all_gather", nbytes, dp)}
    if strategy == "hybrid_shard":
        g = shard or dp
        inside = _ring("reduce_scatter", nbytes, g) + 2 * _ring("all_gather", nbytes, g)
        return {"shard": inside, "replicate": _ring("all_reduce", nbytes / g, dp // g)}
    raise ValueError(f"strategy={strategy!r} is not known; allowed {sorted(SHARDED)}")


def tensor_parallel_wire_bytes(g: Activations, tp: int, *, pp: int = 1, dtype: str = "bf16") -> float:
    """Bytes one rank sends per step for tensor parallel: 4 all-reduces of sbh per layer on its L/pp layers
    (all-gather + reduce-scatter under sequence parallel move the same bytes)."""
    sbh = g.seq_len * g.batch_size * g.hidden_size * DTYPE_BYTES[dtype]
    return 4 * _ring("all_reduce", sbh, tp) * g.num_layers / pp


def pipeline_wire_bytes(g: Activations, pp: int, *, tp: int = 1, dtype: str = "bf16") -> float:
    """Bytes a middle pipeline stage sends per step: this rank's batch as activations forward and gradients back
    (split into microbatches, the same total), 1/tp of it per tensor-parallel rank under sequence parallel."""
    if pp <= 1:
        return 0.0
    return 2 * g.seq_len * g.batch_size * g.hidden_size * DTYPE_BYTES[dtype] / tp
