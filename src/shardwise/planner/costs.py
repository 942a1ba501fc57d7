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
parallel (p) first divide Ψ by t x p (embeddings split too: Megatron's vocabulary-parallel embedding; a mixture of
experts' experts by p only, below); the data-parallel strategy then divides what is left over its dp ranks.

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
(fp32 logits for the loss). Context parallel (cp ranks split each sequence: shardwise.context_parallel) leaves each
rank T/cp tokens of every sequence in every layer, so every term above, logits included, is divided by cp; the
attention-score term becomes this rank's queries' rows of the a x s x s matrix (shardwise's ring and Ulysses
attention store no score matrix at all: `attention="fused"` models them exactly).

**Expert parallel** (docs/experts.md). A mixture-of-experts model has Ψ = D + X parameters, D dense and X in its
experts. ep borrows its ranks from the dp x cp data-parallel ones: each rank holds X/ep of the expert parameters,
the ranks holding the same experts form the expert-data-parallel group edp = dp x cp / ep, and the data-parallel
strategy treats the two families apart (shardwise/sharding/expert_units.py; DeepSpeed-MoE's expert data
parallelism, Rajbhandari et al. 2022): D as over dp x cp, X/ep with the same formula over edp (ZeRO-3: 16X/ep/edp =
16X/(dp x cp), as the dense ones; DDP and no_shard: 16X/ep). hybrid_shard, whose shard groups cut across edp, is
refused, and so is ep that does not divide dp x cp. CPU offload moves each family's shards as above. Tensor
parallel keeps the MoE layers whole on every tp rank (expert-tensor-parallel size 1: router and experts
replicated, the "gpt" plan), so it divides D but not X: the experts are divided by the pipeline stages p only, with
or without ep. Their gradients reduce over edp (over dp x cp when ep = 1); under sequence parallel each tp rank's
MoE gradient is a partial sum, all-reduced over tp (counted with the tensor-parallel traffic).

**Bytes on the wire** per rank per step, ring collectives (Patarasuk & Yuan 2009; the ZeRO paper's section 7):
all-reduce of B bytes over n ranks moves 2(n-1)/n B, reduce-scatter and all-gather (n-1)/n B each. DDP, ZeRO-1,
ZeRO-2 and shard_grad_op: 2(N-1)/N x gradient bytes; ZeRO-3 / full_shard: 3(N-1)/N (the parameter all-gather runs
in forward and again in backward); hybrid_shard: 3(g-1)/g within a group of g plus an all-reduce of the 1/g shard
across the N/g groups. Tensor parallel (Megatron): per layer 4 all-reduces of the sbh activations (2 in forward, 2
in backward), the same bytes as all-gather + reduce-scatter under sequence parallel. Pipeline: each stage boundary
sends an activation (sbh) forward and its gradient back per microbatch. Context parallel (ring attention, per layer):
the K and V blocks (2 x b (s/cp) h values) travel cp - 1 hops forward, and cp - 1 hops plus a last hop home with
their gradients in backward: (3cp - 2) x 2b(s/cp)h; Ulysses: four all-to-alls of q, k, v and the output forward and
their inverses backward, 8 b (s/cp) h values of which (cp-1)/cp leave the rank. Expert parallel, per MoE layer and
step (docs/experts.md): one all-to-all of the E int64 routing counts and four of rows of h values (each rank's N k
assignments dispatched forward and their gradients combined backward; the rows its experts received combined forward
and their gradients dispatched backward), N = b s / cp this rank's tokens (/ t under sequence parallel, where each
tp rank routes its own shard of the sequence): a payload of 8E + 4 N k h w bytes, of which (ep-1)/ep leaves the rank
when the routing is uniform.
"""

from __future__ import annotations

import dataclasses
import math

__all__ = ["SHARDED", "OPTIMIZER_BYTES", "DTYPE_BYTES", "OFFLOAD_LEVELS", "ATTENTION", "ModelStates", "Activations",
           "model_states", "activation_bytes", "data_parallel_wire_bytes", "tensor_parallel_wire_bytes",
           "pipeline_wire_bytes", "context_parallel_wire_bytes", "CP_METHODS", "Experts", "expert_all_to_all_bytes",
           "expert_parallel_wire_bytes", "default_shape"]

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
#: context-parallel attention methods (shardwise.context_parallel): their traffic differs, their memory does not.
CP_METHODS = ("ring", "ulysses")
#: bytes of one routing count in the expert-parallel all-to-all (int64)
COUNT_BYTES = 8


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
                 model_parallel: int = 1, offload: str | None = None, shard: int | None = None,
                 expert_params: float = 0.0, ep: int = 1, tp: int = 1) -> ModelStates:
    """Model-state bytes per rank (see the module docstring).

    psi: parameters of the whole model; strategy: a key of SHARDED; dp: data-parallel ranks (dp x cp under context
    parallel: the ranks dense gradients average over); model_parallel: t x p, the ranks that split the model before
    data parallel; shard: the shard-group size of hybrid_shard (default dp). expert_params: X of the psi parameters
    that sit in experts, split over ep expert-parallel ranks (ep must divide dp) and sharded by the strategy over
    edp = dp / ep; tp: the t of model_parallel, which splits the dense parameters but not the experts (the MoE
    layers stay whole on every tensor-parallel rank). Without experts, or with ep = tp = 1, the experts are
    parameters like the others.
    """
    x = _expert_split(psi, strategy, dp, model_parallel, expert_params, ep, tp)
    if x == 0.0:
        return _model_states(psi, strategy, dp, dtype, optimizer, model_parallel, offload, shard)
    dense = _model_states(psi - x, strategy, dp, dtype, optimizer, model_parallel, offload, shard)
    # The experts: X / ep on this rank, split by the pipeline only, sharded over the edp ranks holding the same ones
    # (with ep = 1, edp is the data-parallel group and hybrid_shard's shard groups apply to them as to the others).
    experts = _model_states(x / ep, strategy, dp // ep, dtype, optimizer, model_parallel // tp, offload,
                            shard if ep == 1 else None)
    return ModelStates(dense.params + experts.params, dense.grads + experts.grads,
                       dense.optimizer + experts.optimizer, dense.cpu + experts.cpu)


def _expert_split(psi: float, strategy: str, dp: int, model_parallel: int, expert_params: float, ep: int,
                  tp: int) -> float:
    """The expert parameters to count apart (0.0: none, or nothing tells them from the dense ones); ValueError for a
    layout the engines refuse (module docstring)."""
    if ep == 1 and tp == 1 and not expert_params:
        return 0.0
    for name, value in (("ep", ep), ("tp", tp), ("dp", dp), ("model_parallel", model_parallel)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if model_parallel % tp:
        raise ValueError(f"tp={tp} must divide model_parallel={model_parallel} (t x p)")
    if strategy not in SHARDED:
        raise ValueError(f"strategy={strategy!r} is not known; allowed {sorted(SHARDED)}")
    if ep == 1:
        if not 0 <= expert_params <= psi:
            raise ValueError(f"expert_params={expert_params!r} must be in [0, {psi:g}]")
        return float(expert_params) if tp > 1 else 0.0
    if not 0 < expert_params <= psi:
        raise ValueError(f"ep={ep} needs the expert parameters, 0 < expert_params <= {psi:g}; got {expert_params!r}")
    if dp % ep:
        raise ValueError(f"ep={ep} must divide the data-parallel ranks dp x cp = {dp} (expert parallel borrows its "
                         f"ranks from them)")
    if strategy == "hybrid_shard":
        raise ValueError(f"ep={ep} with hybrid_shard is not supported: its shard groups cut across the ranks holding "
                         f"the same experts (edp); allowed {sorted(k for k in SHARDED if k != 'hybrid_shard')}")
    return float(expert_params)


def _model_states(psi: float, strategy: str, dp: int, dtype: str, optimizer: str, model_parallel: int,
                  offload: str | None, shard: int | None) -> ModelStates:
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
                     dtype: str = "bf16", cp: int = 1) -> float:
    """Peak activation bytes on one rank for one step (see the module docstring for the assumptions).

    g.batch_size is this rank's batch per step; a pipeline of pp stages splits it into n_microbatches (default 2 x
    pp) and its first stage holds min(pp, n_microbatches) microbatches of L/pp layers. checkpointing: True (every
    layer), False, or k: every k-th layer (the k-th, 2k-th, ...: floor(L/k) of them, `activation_checkpointing.
    every_kth`) keeps only its input; the others keep everything. cp: context-parallel ranks splitting each sequence
    (g.seq_len is the whole sequence; each rank holds seq_len / cp tokens of it, so everything is divided by cp).
    """
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp={cp!r} must be a positive int")
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
    return total * DTYPE_BYTES[dtype] / 2 / cp


def _ring(kind: str, nbytes: float, n: int) -> float:
    if n <= 1:
        return 0.0
    factor = 2 if kind == "all_reduce" else 1
    return factor * (n - 1) / n * nbytes


def data_parallel_wire_bytes(psi: float, strategy: str, dp: int, *, dtype: str = "bf16", model_parallel: int = 1,
                             shard: int | None = None, expert_params: float = 0.0, ep: int = 1,
                             tp: int = 1) -> dict[str, float]:
    """Bytes one rank sends per step for the data-parallel strategy, by group: {"dp": ...} or, for hybrid_shard,
    {"shard": within the group, "replicate": across the groups}. Gradients travel in the training dtype. With
    experts (`model_states`' arguments), the dense psi - expert_params go over dp and this rank's expert_params / ep,
    divided by the pipeline only, with the same strategy over the dp / ep ranks holding the same experts: under
    "edp" when ep > 1, added to the dense groups' bytes when ep = 1."""
    x = _expert_split(psi, strategy, dp, model_parallel, expert_params, ep, tp)
    if x == 0.0:
        return _wire(psi / model_parallel, strategy, dp, dtype, shard)
    dense = _wire((psi - x) / model_parallel, strategy, dp, dtype, shard)
    experts = _wire(x / ep / (model_parallel // tp), strategy, dp // ep, dtype, shard if ep == 1 else None)
    if ep == 1:
        return {k: dense[k] + experts[k] for k in dense}
    return {**dense, "edp": experts["dp"]}


def _wire(psi: float, strategy: str, dp: int, dtype: str, shard: int | None) -> dict[str, float]:
    """data_parallel_wire_bytes of psi parameters on this rank (after the model-parallel split)."""
    nbytes = DTYPE_BYTES[dtype] * psi
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


def tensor_parallel_wire_bytes(g: Activations, tp: int, *, pp: int = 1, dtype: str = "bf16",
                               partial_grads: float = 0.0) -> float:
    """Bytes one rank sends per step for tensor parallel: 4 all-reduces of sbh per layer on its L/pp layers
    (all-gather + reduce-scatter under sequence parallel move the same bytes). partial_grads: bytes of gradients this
    rank holds as partial sums over tp (replicated parameters that sequence parallel runs on each rank's share of the
    tokens: a MoE layer kept whole by the "gpt" plan, its router and this rank's experts), all-reduced over tp."""
    sbh = g.seq_len * g.batch_size * g.hidden_size * DTYPE_BYTES[dtype]
    return 4 * _ring("all_reduce", sbh, tp) * g.num_layers / pp + _ring("all_reduce", partial_grads, tp)


def pipeline_wire_bytes(g: Activations, pp: int, *, tp: int = 1, dtype: str = "bf16") -> float:
    """Bytes a middle pipeline stage sends per step: this rank's batch as activations forward and gradients back
    (split into microbatches, the same total), 1/tp of it per tensor-parallel rank under sequence parallel."""
    if pp <= 1:
        return 0.0
    return 2 * g.seq_len * g.batch_size * g.hidden_size * DTYPE_BYTES[dtype] / tp


def context_parallel_wire_bytes(g: Activations, cp: int, *, pp: int = 1, dtype: str = "bf16",
                                method: str = "ring", tp: int = 1) -> float:
    """Bytes one rank sends per step for context parallel on its L/pp layers (module docstring): ring attention
    (3cp - 2) x |K| + |V| per layer, Ulysses (cp-1)/cp x 8 b (s/cp) h; |K| = |V| = b (s/cp) h values. g.seq_len is
    the whole sequence, g.batch_size this rank's sequences per step (its dp replica's). Under tensor parallel a
    rank's attention holds 1/tp of the heads, so it exchanges 1/tp of those bytes."""
    if method not in CP_METHODS:
        raise ValueError(f"method={method!r} is not known; allowed {CP_METHODS}")
    if cp <= 1:
        return 0.0
    chunk = g.batch_size * g.seq_len / cp * g.hidden_size * DTYPE_BYTES[dtype]  # this rank's b x s/cp x h
    per_layer = (3 * cp - 2) * 2 * chunk if method == "ring" else (cp - 1) / cp * 8 * chunk
    return per_layer * g.num_layers / pp / tp


@dataclasses.dataclass(frozen=True)
class Experts:
    """The mixture-of-experts part of a model: `params` (X, the parameters inside the experts of every MoE layer,
    all E of each; routers excluded), `n_experts` (E per layer), `per_token` (k, experts each token is routed to)
    and `layers` (how many layers are MoE; None: every layer of the geometry). E, k may be 0 when unknown: the
    memory needs only X, the all-to-all bytes need E and k."""

    params: float
    n_experts: int = 0
    per_token: int = 0
    layers: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.params, bool) or not isinstance(self.params, (int, float)) \
                or not math.isfinite(self.params) or self.params < 0:
            raise ValueError(f"expert_params={self.params!r} must be a number of parameters >= 0")
        for name, value in (("n_experts", self.n_experts), ("experts_per_token", self.per_token)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be an int >= 0 (0: unknown)")
        if self.n_experts and self.per_token > self.n_experts:
            raise ValueError(f"experts_per_token={self.per_token} must be at most n_experts={self.n_experts}")


def expert_all_to_all_bytes(g: Activations, experts: Experts, *, cp: int = 1, pp: int = 1, dtype: str = "bf16",
                            n_microbatches: int = 1, sp: int = 1) -> float:
    """All-to-all payload one rank puts in per step over its MoE layers (L_moe/pp of them; module docstring):
    8E m + 4 N k h w bytes per layer, N = g.batch_size x g.seq_len / (cp x sp) this rank's tokens, m the forwards per
    step (n_microbatches: each exchanges its own counts; the rows add up to the same N); sp: the tensor-parallel
    ranks splitting each sequence under sequence parallel (1 without it: every tp rank routes all of its replica's
    tokens, as the "gpt" plan keeps the MoE layers whole). The payload is what
    `CommStats.bytes("all_to_all")` counts (each call's whole input); summed over an ep group it is exact (a rank
    receives more or fewer rows as the routing falls; the group's received rows are its sent rows)."""
    if not (experts.n_experts and experts.per_token):
        raise ValueError("the all-to-all bytes need n_experts and experts_per_token")
    layers = experts.layers if experts.layers is not None else g.num_layers
    tokens = g.batch_size * g.seq_len / cp / sp
    counts = COUNT_BYTES * experts.n_experts * n_microbatches
    per_layer = counts + 4 * tokens * experts.per_token * g.hidden_size * DTYPE_BYTES[dtype]
    return per_layer * layers / pp


def expert_parallel_wire_bytes(g: Activations, experts: Experts, ep: int, *, cp: int = 1, pp: int = 1,
                               dtype: str = "bf16", n_microbatches: int = 1, sp: int = 1) -> float:
    """Bytes one rank sends per step in the expert-parallel all-to-alls: (ep-1)/ep of `expert_all_to_all_bytes`
    (the share of a uniform routing that goes to the other ranks; 0 for ep = 1)."""
    if ep <= 1:
        return 0.0
    return (ep - 1) / ep * expert_all_to_all_bytes(g, experts, cp=cp, pp=pp, dtype=dtype,
                                                   n_microbatches=n_microbatches, sp=sp)
