"""Choose the fastest layout that fits, and say why: the planner behind `sw.distribute` and `shardwise plan`.

Each candidate (candidates.py) gets its memory per rank (costs.py: model states, plus activations when the
geometry is known, plus the gathered units that ZeRO-3 holds while computing) and its bytes on the wire per step.
A candidate fits when its device bytes stay within `fit_fraction` (default 90%) of the memory per rank: the rest is
left to the allocator's fragmentation, the CUDA context and temporary buffers the formulas do not count.

Among those that fit, the choice follows the order practitioners use (HF Accelerate's and DeepSpeed's guides,
Megatron's "tensor parallel within a node, pipeline across"): plain data parallel and its sharded variants first,
then tensor parallel within a node, then pipeline meshes (whose bubble idles (p-1)/(m+p-1) of each step), then CPU
offload (the optimizer steps on the CPU, over PCIe). Within a tier the one with the least estimated communication
time wins: bytes per step over the bandwidth of the links each group crosses (`Links`: a group larger than a node
crosses the slower inter-node links; offload adds its PCIe traffic and the CPU's pass over the optimizer state).
Equal times keep the simpler layout (the listed order: DDP before ZeRO-1 before ZeRO-2 ...).
"""

from __future__ import annotations

import dataclasses
import math

from . import costs
from .candidates import Candidate, candidates, parse_strategy

__all__ = ["Workload", "Links", "Estimate", "Plan", "estimate", "plan", "smallest_world"]

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Workload:
    """What is trained: Ψ parameters, the training dtype ("fp32", "bf16", "fp16"), the optimizer (a key of
    costs.OPTIMIZER_BYTES) and, when known, the activation geometry (this rank's batch per step: its dp replica's
    whole sequences, which context parallel splits) and the hidden size (which sizes ZeRO-3's gathered layers;
    default: the activations', else costs.default_shape). experts: the mixture-of-experts part of num_params (what
    expert-parallel candidates split; None: a dense model)."""

    num_params: float
    dtype: str = "bf16"
    optimizer: str = "adamw"
    activations: costs.Activations | None = None
    checkpointing: bool = False
    attention: str = "eager"
    sequence_parallel: bool = False
    hidden_size: int | None = None
    experts: costs.Experts | None = None

    def __post_init__(self) -> None:
        if isinstance(self.num_params, bool) or not isinstance(self.num_params, (int, float)) \
                or not math.isfinite(self.num_params) or self.num_params < 1:
            raise ValueError(f"num_params={self.num_params!r} must be a positive number of parameters (e.g. 7e9)")
        if self.dtype not in costs.DTYPE_BYTES:
            raise ValueError(f"dtype={self.dtype!r} is not known; allowed {sorted(costs.DTYPE_BYTES)}")
        if self.optimizer not in costs.OPTIMIZER_BYTES:
            raise ValueError(f"optimizer={self.optimizer!r} is not known; allowed {sorted(costs.OPTIMIZER_BYTES)}")
        if self.attention not in costs.ATTENTION:
            raise ValueError(f"attention={self.attention!r} is not known; allowed {costs.ATTENTION}")
        if self.experts is not None and not isinstance(self.experts, costs.Experts):
            raise ValueError(f"experts={self.experts!r} must be a planner.costs.Experts or None")
        if self.experts is not None and self.experts.params > self.num_params:
            raise ValueError(f"expert_params={self.experts.params:g} exceeds num_params={self.num_params:g}")


@dataclasses.dataclass(frozen=True)
class Links:
    """The machine: ranks, ranks per node, device memory per rank (bytes; None: unknown, everything fits) and link
    bandwidths in GB/s (defaults: NVLink-class within a node, 100 Gb/s between nodes, PCIe 4 x16, one CPU core
    group streaming the optimizer state)."""

    world_size: int
    devices_per_node: int
    memory: float | None = None
    intra_node_gbps: float = 150.0
    inter_node_gbps: float = 12.5
    pcie_gbps: float = 25.0
    cpu_gbps: float = 10.0
    fit_fraction: float = 0.9
    source: str = "assumed: NVLink-class within a node, 100 Gb/s between nodes"  # said by explain()

    def __post_init__(self) -> None:
        for name in ("world_size", "devices_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.memory is not None and not self.memory > 0:
            raise ValueError(f"memory={self.memory!r} must be a positive number of bytes per rank or None")
        if not 0 < self.fit_fraction <= 1:
            raise ValueError(f"fit_fraction={self.fit_fraction!r} must be in (0, 1]")

    def bandwidth(self, group_span: int) -> float:
        """Bytes per second of a collective over a group whose ranks span `group_span` consecutive ranks."""
        return (self.intra_node_gbps if group_span <= self.devices_per_node else self.inter_node_gbps) * GB


@dataclasses.dataclass(frozen=True)
class Estimate:
    """One candidate's figures per rank: model states (device and CPU), activations (None: geometry unknown), the
    gathered working units, wire bytes per step by group, the estimated communication seconds per step, the tier of
    the choice order, and whether it fits."""

    candidate: Candidate
    states: costs.ModelStates
    activations: float | None
    working: float
    wire: dict[str, float]
    seconds: float
    tier: int
    fits: bool
    uncounted: tuple[str, ...] = ()

    @property
    def device(self) -> float:
        return self.states.device + (self.activations or 0.0) + self.working

    @property
    def wire_total(self) -> float:
        return sum(self.wire.values())


def _check_experts(c: Candidate, work: Workload) -> costs.Experts | None:
    """The workload's experts (None: a dense model); ValueError when candidate c splits experts (ep > 1) that the
    model lacks or that ep does not divide."""
    x = work.experts if work.experts is not None and work.experts.params else None
    if c.ep == 1:
        return x
    if x is None:
        raise ValueError(f"strategy={c.strategy!r}: ep={c.ep} splits the experts of a mixture of experts, but the "
                         f"model has none (give the expert parameters: shardwise plan --expert-params, or a model "
                         f"with MoE layers)")
    if x.n_experts and x.n_experts % c.ep:
        raise ValueError(f"strategy={c.strategy!r}: ep={c.ep} must divide the {x.n_experts} experts of each layer")
    return x


def estimate(c: Candidate, work: Workload, links: Links) -> Estimate:
    """The figures of candidate `c` (see the module docstring)."""
    psi, dtype, mp = work.num_params, work.dtype, c.model_parallel
    experts = _check_experts(c, work)
    # The experts are split by ep and the pipeline, not by tensor parallel (it keeps the MoE layers whole).
    moe = {"expert_params": experts.params, "ep": c.ep, "tp": c.tp} if experts else {}
    data = c.data_parallel  # dp x cp: the ranks dense gradients average over
    states = costs.model_states(psi, c.states_key, data, dtype=dtype, optimizer=work.optimizer, model_parallel=mp,
                                offload=c.offload, shard=c.shard, **moe)
    wire = {k: v for k, v in costs.data_parallel_wire_bytes(psi, c.states_key, data, dtype=dtype, model_parallel=mp,
                                                             shard=c.shard, **moe).items() if v}
    g = work.activations
    hidden = g.hidden_size if g else work.hidden_size or costs.default_shape(psi)[0]
    acts = None
    if g is not None:
        sp = work.sequence_parallel and c.tp > 1
        acts = costs.activation_bytes(g, tp=c.tp, pp=c.pp, sequence_parallel=sp, checkpointing=work.checkpointing,
                                      attention=work.attention, dtype=dtype, cp=c.cp)
        micro = dataclasses.replace(g, seq_len=g.seq_len // c.cp) if c.cp > 1 else g  # this rank's tokens (/ cp)
        if c.tp > 1:  # under sequence parallel each tp rank's MoE gradients are partial sums over tp
            partial = costs.DTYPE_BYTES[dtype] * experts.params / c.ep / c.pp if experts is not None and sp else 0.0
            wire["tp"] = costs.tensor_parallel_wire_bytes(micro, c.tp, pp=c.pp, dtype=dtype, partial_grads=partial)
        if c.pp > 1:  # this rank's tokens: its replica's sequences, split over cp
            wire["pp"] = costs.pipeline_wire_bytes(micro, c.pp, tp=c.tp if sp else 1, dtype=dtype)
        if c.cp > 1:  # ring attention, sw.parallelize's default cp_method, on this rank's n_heads / tp heads
            wire["cp"] = costs.context_parallel_wire_bytes(g, c.cp, pp=c.pp, dtype=dtype, tp=c.tp)
        if c.ep > 1 and experts.n_experts and experts.per_token:
            wire["ep"] = costs.expert_parallel_wire_bytes(g, experts, c.ep, cp=c.cp, pp=c.pp, dtype=dtype,
                                                          sp=c.tp if sp else 1)
    # ZeRO-3 gathers a unit (a layer, 12h^2 parameters split by tp, as FSDP's transformer wrapping policy cuts them;
    # the pipeline splits the layers among stages, not a layer) and prefetches the next while computing: two units,
    # never more than this rank's share of the model. A MoE layer's unit is its attention (4h^2, split by tp) and
    # this rank's experts of that layer (X / (L_moe ep), not split by tp).
    gathers = c.states_key in ("zero3", "full_shard", "hybrid_shard")
    working = 0.0
    if gathers and experts is None:
        working = min(2 * 12 * hidden ** 2 / c.tp, psi / mp) * costs.DTYPE_BYTES[dtype]
    elif gathers:
        moe_layers = experts.layers or (g.num_layers if g else costs.default_shape(psi)[1])
        unit = 4 * hidden ** 2 / c.tp + experts.params / (moe_layers * c.ep)
        held = (psi - experts.params) / mp + experts.params / (c.ep * c.pp)
        working = min(2 * unit, held) * costs.DTYPE_BYTES[dtype]
    # Which links each group crosses: ranks are laid out tp fastest, then cp, then dp, then pp (Mesh's order); the
    # experts' groups lie within dp x cp (ep: ep consecutive dp x cp indices; edp: strided across them).
    spans = {"dp": data * c.tp, "shard": (c.shard or data) * c.tp, "replicate": data * c.tp, "tp": c.tp,
             "pp": links.world_size, "cp": c.cp * c.tp, "ep": c.ep * c.tp, "edp": data * c.tp}
    seconds = sum(b / links.bandwidth(spans[k]) for k, b in wire.items())
    if c.offload:  # gradients down and parameters up over PCIe, the optimizer's pass over its state on the CPU
        width = costs.DTYPE_BYTES[dtype]
        x = experts.params if experts is not None else 0.0  # this rank's share: X / (p x dp x cp) with any ep
        shard = ((psi - x) / mp + x / c.pp) / (c.shard or data)
        pcie = 2 * width * shard * (3 if c.offload == "full" else 1)
        seconds += pcie / (links.pcie_gbps * GB) + states.cpu / (links.cpu_gbps * GB)
    tier = 3 if c.offload else 2 if c.pp > 1 else 1 if c.tp > 1 else 0
    fits = links.memory is None or (states.device + (acts or 0.0) + working) <= links.fit_fraction * links.memory
    # Without the activation geometry the tensor-, pipeline-, context- and expert-parallel traffic cannot be
    # counted (nor the all-to-all without E and k): say so.
    uncounted = () if g is not None else tuple(a for a, size in (("tp", c.tp), ("pp", c.pp), ("cp", c.cp),
                                                                  ("ep", c.ep)) if size > 1)
    if g is not None and c.ep > 1 and "ep" not in wire:
        uncounted = ("ep",)
    return Estimate(c, states, acts, working, wire, seconds, tier, fits, uncounted)


def _size(x: float | None) -> str:
    """Bytes in GB (10^9, the ZeRO paper's unit), or MB below 0.1 GB so that small models show figures too."""
    if x is None:
        return "-"
    if x >= 0.1 * GB or x == 0:
        return f"{x / GB:.1f} GB"
    return f"{x / 1e6:.1f} MB" if x >= 1e5 else f"{x:,.0f} bytes"


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,.0f}"


@dataclasses.dataclass(frozen=True)
class Plan:
    """The planner's answer: the chosen layout, every candidate's figures, and why. `explain()` says it in words.

    given: True when the caller named the strategy (no choice was made; the figures are still shown).
    """

    chosen: Estimate
    estimates: tuple[Estimate, ...]
    workload: Workload
    links: Links
    reason: str
    given: bool = False

    @property
    def strategy(self) -> str:
        """The chosen strategy string (the offload level is `candidate.offload`)."""
        return self.chosen.candidate.strategy

    @property
    def candidate(self) -> Candidate:
        return self.chosen.candidate

    def table(self, mark: bool = True) -> str:
        """The candidates as a fixed-width table (GB of 10^9 bytes, per rank); mark: point at the chosen one."""
        width = max(len("strategy"), *(len(e.candidate.label) for e in self.estimates))
        # One unit for the whole table: GB (10^9 bytes, the ZeRO paper's), or MB for models under ~0.1 GB.
        top = max(max(e.device, e.wire_total, e.states.cpu) for e in self.estimates)
        unit, scale = ("GB", GB) if top >= 0.1 * GB else ("MB", 1e6)

        def f(x: float | None) -> str:
            return "-" if x is None else f"{x / scale:.1f}"

        head = (f"  {'strategy':<{width}}  {'states':>7}  {'activ.':>7}  {'total':>7}  {'cpu':>6}  "
                f"{'wire/step':>9}  {'comm s':>8}  fits      ({unit} per rank)")
        rows = [head]
        for e in self.estimates:
            chosen = " <- chosen" if mark and e is self.chosen else ""
            wire = f(e.wire_total) + ("+" if e.uncounted else "")
            rows.append(f"  {e.candidate.label:<{width}}  {f(e.states.device):>7}  {f(e.activations):>7}  "
                        f"{f(e.device):>7}  {f(e.states.cpu) if e.states.cpu else '-':>6}  "
                        f"{wire:>9}  {e.seconds:>8.3g}  {'yes' if e.fits else 'no'}{chosen}")
        if any(e.uncounted for e in self.estimates):
            rows.append("  +: plus tensor/pipeline/context-parallel activation traffic and expert-parallel "
                        "all-to-alls, not counted without seq_len and batch_size (the all-to-alls: and the experts' "
                        "count and experts per token)")
        return "\n".join(rows)

    def assumptions(self) -> str:
        w, links = self.workload, self.links
        k = costs.OPTIMIZER_BYTES[w.optimizer][0 if costs.DTYPE_BYTES[w.dtype] == 2 else 1]
        per_param = 2 * costs.DTYPE_BYTES[w.dtype] + k
        precision = f"{w.dtype} mixed precision" if costs.DTYPE_BYTES[w.dtype] == 2 else "fp32"
        memory = "unknown (every candidate fits)" if links.memory is None else \
            f"{_size(links.memory)} per rank, fits within {links.fit_fraction:.0%} = " \
            f"{_size(links.fit_fraction * links.memory)}"
        ranks = f"{links.world_size} rank{'s' if links.world_size != 1 else ''}"
        lines = [f"{_count(w.num_params)} parameters, {precision}, {w.optimizer}: {per_param} bytes per "
                 f"parameter of model states (ZeRO paper); {ranks}, {links.devices_per_node} per node; memory "
                 f"{memory}."]
        g = w.activations
        if g is None:
            lines.append("Activations: not counted (give seq_len and batch_size; hidden size and layers come from "
                         "the model or are derived from the parameter count).")
        else:
            lines.append(f"Activations (Korthikanti et al. 2022): s={g.seq_len}, b={g.batch_size} per rank, "
                         f"h={g.hidden_size}, L={g.num_layers}, a={g.num_heads}"
                         f"{f', V={g.vocab_size}' if g.vocab_size else ''}; {w.attention} attention, activation "
                         f"checkpointing {'on' if w.checkpointing else 'off'}"
                         f"{', sequence parallel' if w.sequence_parallel else ''}.")
        x = w.experts
        if x is not None and x.params:
            shape = f" ({x.n_experts} per layer, {x.per_token} per token)" if x.n_experts and x.per_token else ""
            lines.append(f"Mixture of experts: {_count(x.params)} of the parameters are in experts{shape}; an ep "
                         f"layout holds 1/ep of them, their gradients and optimizer state sharded by its data-"
                         f"parallel strategy over the dp x cp / ep ranks holding the same experts, the dense ones "
                         f"over dp x cp; tensor parallel keeps the experts whole (it splits the dense parameters "
                         f"only); the ep all-to-alls assume uniform routing.")
        if any(e.candidate.cp > 1 for e in self.estimates):
            lines.append("Context parallel: each of the cp ranks holds 1/cp of every sequence (activations / cp; "
                         "b is a dp replica's sequences); dense gradients average over dp x cp; ring attention's "
                         "K/V traffic.")
        lines.append(f"Links: {links.intra_node_gbps:g} GB/s within a node, {links.inter_node_gbps:g} GB/s between "
                     f"nodes, PCIe {links.pcie_gbps:g} GB/s ({links.source}); ring collectives; 'comm s' = wire "
                     f"bytes / link bandwidth (+ offload traffic), not overlapped with compute.")
        return "\n".join(lines)

    def explain(self) -> str:
        """The assumptions, the table of candidates, the choice and why."""
        verb = "Given" if self.given else "Chosen"
        return (f"{self.assumptions()}\n{self.table()}\n{verb}: {self.chosen.candidate.label}. {self.reason}")


def _reason(chosen: Estimate, estimates: list[Estimate], links: Links) -> str:
    misfits = [e for e in estimates if not e.fits and (e.tier, e.seconds) < (chosen.tier, chosen.seconds)]
    parts = []
    if misfits and links.memory is not None:
        shown = ", ".join(f"{e.candidate.label} needs {_size(e.device)}" for e in misfits[:4])
        more = f" and {len(misfits) - 4} more" if len(misfits) > 4 else ""
        parts.append(f"Faster layouts do not fit in {_size(links.fit_fraction * links.memory)} per rank "
                     f"({shown}{more}).")
    tier = ["data parallel", "tensor parallel within a node", "a pipeline mesh", "CPU offload"][chosen.tier]
    rivals = [e for e in estimates if e.fits and e.tier == chosen.tier and e is not chosen]
    if rivals:
        best = min(rivals, key=lambda e: e.seconds)
        how = "the same time; the simpler layout is kept" if math.isclose(best.seconds, chosen.seconds) else \
            f"{best.seconds:.3g} s for the next, {best.candidate.label}"
        parts.append(f"Of the layouts that fit, it is the fastest of the '{tier}' tier: {_size(chosen.wire_total)} "
                     f"on the wire per step, about {chosen.seconds:.3g} s of communication ({how}).")
    else:
        traffic = "" if chosen.uncounted else f", {_size(chosen.wire_total)} on the wire per step"
        parts.append(f"It is the only '{tier}' layout that fits: {_size(chosen.device)} per rank{traffic}.")
    if chosen.tier:
        parts.append("Tiers in order: data parallel, tensor parallel within a node, pipeline, CPU offload.")
    return " ".join(parts)


def smallest_world(work: Workload, links: Links, *, limit: int = 1 << 16, **allowed: bool) -> int | None:
    """The smallest world size > links.world_size (same ranks per node; whole nodes once past one node) on which
    some candidate fits, or None up to `limit` (activations do not shrink with more data-parallel ranks)."""
    node = links.devices_per_node
    n = links.world_size + 1
    while n <= limit:
        if n > node and n % node:
            n += node - n % node
            continue
        trial = dataclasses.replace(links, world_size=n)
        if any(estimate(c, work, trial).fits for c in candidates(n, node, **allowed)):
            return n
        n += 1 if n < 64 else max(1, n // 64)  # fine steps first, then ~1.5% steps (world sizes come rounded)
    return None


def plan(work: Workload, links: Links, *, strategy: str | Candidate = "auto", shard_size: int | None = None,
         offload_level: str | None = None, pool: list[Candidate] | None = None, **allowed: object) -> Plan:
    """Plan `work` on `links`: strategy="auto" chooses (module docstring); any other strategy string (or a
    Candidate, with `offload_level` for the sharded engine) is estimated as given. pool: the candidates to compare (default `candidates()` with `allowed`:
    tensor_parallel, pipeline, offload (bools), max_pp, tp_divides). Raises ValueError when strategy="auto" and
    nothing fits, naming the smallest world size that would."""
    n, node = links.world_size, links.devices_per_node
    if pool is None:
        pool = candidates(n, node, **allowed)
    if strategy != "auto":
        given = strategy if isinstance(strategy, Candidate) else \
            parse_strategy(strategy, n, shard_size=shard_size, devices_per_node=node, offload=offload_level)
        chosen = estimate(given, work, links)
        others = [estimate(c, work, links) for c in pool if c != given]
        note = "" if chosen.fits else (f" Warning: it is estimated at {_size(chosen.device)} per rank, more than "
                                       f"{links.fit_fraction:.0%} of the {_size(links.memory)} available.")
        return Plan(chosen, (chosen, *others), work, links, f"Named by the caller.{note}", given=True)
    estimates = [estimate(c, work, links) for c in pool]
    fitting = [e for e in estimates if e.fits]
    if not fitting:
        need = min(estimates, key=lambda e: e.device)
        bigger = smallest_world(work, links, **allowed)
        where = (f"the smallest world size that would fit is {bigger} ranks ({node} per node)" if bigger else
                 "no world size up to 65536 fits (what a rank holds besides its shard does not shrink with more "
                 "ranks: activations, ZeRO-3's gathered layers; lower the batch or sequence length, or turn on "
                 "activation checkpointing)")
        raise ValueError(f"no strategy fits {_count(work.num_params)} parameters on {n} ranks with "
                         f"{_size(links.memory)} per rank: the smallest, {need.candidate.label}, needs "
                         f"{_size(need.device)} (within {links.fit_fraction:.0%}); {where}.\n"
                         f"{Plan(need, tuple(estimates), work, links, '').table(mark=False)}")
    chosen = min(fitting, key=lambda e: (e.tier, round(e.seconds, 12)))  # min() keeps the first of equals
    return Plan(chosen, tuple(estimates), work, links, _reason(chosen, estimates, links))
