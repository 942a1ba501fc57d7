"""`sw.distribute(model)`: one call that picks a layout that fits, applies it, and says why.

    model = sw.distribute(model)                       # sw.init() from the launcher's environment, strategy="auto"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    print(model.plan.explain())                        # candidates, memory per rank, bytes per step, the choice

"auto" plans with `shardwise.planner` from the model's parameter count (and geometry, when its config has one),
the optimizer and dtype the caller names, the world size, the ranks per node and the memory per rank
(`planner.machine.probe`: CUDA free memory, or the host's available RAM shared by its ranks, or `memory_gb`).
Rank 0 decides and broadcasts what it saw and what it chose; every rank rebuilds the same plan from that, so ranks
never disagree. Then the chosen layout is built with the library's own wrappers, in the documented way:

    "ddp"                      sw.DDP(model, comm)
    "zero1|2|3"                sw.ZeRO(model, comm, stage=N)          (deepspeed_stage_N: the same)
    "fsdp[:sharding]"          sw.FSDP(model, comm, sharding=...)     (hybrid_shard: shard_size, default a node)
    "tp"                       tensor_parallel.parallelize(model, comm, plan)   (every rank feeds the same batch)
    "3d:dp=A,tp=B,pp=C"        sw.parallelize(model, sw.Mesh(comm, A, B, C), ...) -> HybridModel (model.step(x, y))
    "5d:dp=A,cp=B,ep=C,..."    the same over sw.Mesh(comm, A, cp=B, ep=C, tp=.., pp=..): context and expert parallel

The result trains with a plain loop (the HybridModel with `step`), and carries `model.plan` (a `Distribution`):
`explain()`, `strategy`, and `data_rank` / `data_world`: which slice of the global batch this rank feeds.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from . import layout
from .comm.base import Communicator, is_communicator
from .comm.objects import broadcast_json
from .ddp import DDP
from .hybrid import HybridModel, parallelize
from .launch import get_logger, init
from .mesh import Mesh
from .planner import Candidate, Links, Plan, Workload, candidates, model_facts, parse_strategy, plan
from .planner.costs import OPTIMIZER_BYTES
from .planner.machine import probe
from .sharding import FSDP, MixedPrecision, ZeRO
from .sharding.offload import offload_level
from .estimate import activation_geometry

__all__ = ["distribute", "Distribution", "OPTIONS"]

#: Options of the planner (what it plans for) and of the wrappers (passed to whichever is chosen).
PLANNER_OPTIONS = ("optimizer", "seq_len", "batch_size", "attention", "devices_per_node", "intra_node_gbps",
                   "inter_node_gbps", "fit_fraction", "offload")
WRAPPER_OPTIONS = {
    "mixed_precision": ("zero", "fsdp", "3d"), "activation_checkpointing": ("zero", "fsdp", "3d"),
    "cpu_offload": ("zero", "fsdp"), "wrap": ("zero", "fsdp"), "group_mb": ("zero", "fsdp"),
    "prefetch": ("zero", "fsdp"), "shard_size": ("fsdp",), "bucket_mb": ("ddp",),
    "find_unused_parameters": ("ddp", "3d"), "broadcast_buffers": ("ddp",), "tp_plan": ("tp", "3d"),
    "sequence_parallel": ("tp", "3d"), "pp_schedule": ("3d",), "n_microbatches": ("3d",), "loss_fn": ("3d",),
    "virtual_stages": ("3d",), "cp_method": ("3d",), "batch_norm": ("ddp", "zero", "fsdp"),
    "buffer_writes": ("ddp", "zero", "fsdp", "3d"), "forward_methods": ("ddp", "zero", "fsdp"),
}
OPTIONS = PLANNER_OPTIONS + tuple(WRAPPER_OPTIONS)


@dataclasses.dataclass(frozen=True)
class Distribution:
    """What `distribute` did: the planner's `plan`, this rank's slice of the batch (`data_rank` of `data_world`),
    the options it did not use (they belong to another wrapper), and for a HybridModel the composition's own plan
    (`composition`), whose fields (dp_strategy, pp_schedule, ...) this object also answers."""

    plan: Plan
    data_rank: int
    data_world: int
    unused_options: tuple[str, ...] = ()
    composition: Any = None

    @property
    def strategy(self) -> str:
        return self.plan.strategy

    def explain(self) -> str:
        """The plan's explanation, then how to feed the model."""
        feed = (f"Data: every rank feeds rows [{self.data_rank}*b, {self.data_rank + 1}*b) of a global batch of "
                f"{self.data_world}*b (data_rank={self.data_rank}, data_world={self.data_world})"
                if self.data_world > 1 else "Data: every rank feeds the same batch")
        unused = f"\nOptions not used by this layout: {', '.join(self.unused_options)}" if self.unused_options else ""
        return f"{self.plan.explain()}\n{feed}.{unused}"

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the dataclass lacks: a HybridModel's describe() reads its composition's fields.
        composition = self.__dict__.get("composition")
        if composition is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(composition, name)


def _check_options(options: dict[str, Any]) -> None:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"distribute: unknown option(s) {unknown}; allowed {sorted(OPTIONS)}")
    if options.get("optimizer", "adamw") not in OPTIMIZER_BYTES:
        raise ValueError(f"distribute: optimizer={options['optimizer']!r} is not known; allowed "
                         f"{sorted(OPTIMIZER_BYTES)} (the optimizer you will build; it sizes the optimizer state)")
    mp = options.get("mixed_precision")
    if mp is not None and not isinstance(mp, MixedPrecision):
        raise ValueError(f"distribute: mixed_precision={mp!r} must be a shardwise.MixedPrecision or None")
    for name in ("seq_len", "batch_size", "devices_per_node"):
        value = options.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"distribute: {name}={value!r} must be a positive int")
    if (options.get("seq_len") is None) != (options.get("batch_size") is None) and "seq_len" in options:
        raise ValueError("distribute: activations need both seq_len and batch_size (sequences per rank per step)")


def _dtype(model: nn.Module, mp: MixedPrecision | None) -> str:
    dtype = mp.param_dtype if mp is not None and mp.param_dtype is not None else \
        next(model.parameters()).dtype
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


def _workload(model: nn.Module, options: dict[str, Any]) -> tuple[Workload, dict[str, Any]]:
    """The planner's Workload and the candidate filters the model and options imply."""
    from .models.gpt import GPT
    from .planner.costs import Experts

    facts = model_facts(model)
    mp = options.get("mixed_precision")
    geometry = None
    if options.get("seq_len") is not None:
        geometry = activation_geometry(model, facts.num_params, options["seq_len"], options["batch_size"])
    attention = options.get("attention", "fused" if isinstance(model, GPT) else "eager")  # GPT: SDPA
    ac = options.get("activation_checkpointing", False)
    experts = Experts(facts.expert_params, facts.n_experts, facts.experts_per_token, facts.moe_layers) \
        if facts.expert_params else None
    work = Workload(facts.num_params, _dtype(model, mp), options.get("optimizer", "adamw"), geometry, bool(ac),
                    attention, bool(options.get("sequence_parallel", False)), facts.hidden_size, experts)
    tp_plan = options.get("tp_plan", facts.tp_plan)
    # A MoE balance loss is a function of the whole batch: under a pipeline sw.parallelize computes it per microbatch
    # (balance_loss.py, models/hf_router_loss.py), another loss than the one process the choice must equal, so no
    # pipeline is chosen for it.
    allowed = {"tensor_parallel": tp_plan is not None,
               "pipeline": facts.pipeline_layers is not None and not facts.moe_balance_loss,
               "max_pp": facts.pipeline_layers, "offload": options.get("offload", True),
               "tp_divides": tuple(d for d in (facts.num_heads, facts.vocab_size) if d)}
    return work, allowed


def _usable(c: Candidate, options: dict[str, Any]) -> bool:
    """Whether the options allow candidate c: DDP and plain tensor parallel keep no fp32 master copy (no
    mixed_precision) and have no activation checkpointing of their own."""
    plain = c.kind == "tp" or c.dp_strategy == "ddp"
    if plain and (options.get("mixed_precision") is not None or (c.kind != "3d" and options.get(
            "activation_checkpointing"))):
        return False
    return not (c.offload and options.get("cpu_offload") is False)


def _pool(world: Communicator, mesh: Mesh | None, node: int, device: str, work_allowed: dict[str, Any],
          options: dict[str, Any]) -> list[Candidate]:
    if mesh is not None and _fixed(mesh):  # the mesh is fixed: only dp strategies vary
        pool = [_on_mesh(mesh, d) for d in ("ddp", "zero1", "zero2", "zero3")]
    else:
        allowed = dict(work_allowed, offload=work_allowed["offload"] and device == "cuda")  # CPU: nothing to offload to
        pool = candidates(world.size, node, **allowed)
    usable = [c for c in pool if _usable(c, options)]
    if not usable:  # e.g. mixed_precision (a sharded engine's option) over a pool of DDP layouts only
        raise ValueError(f"distribute: no layout of {', '.join(sorted({c.strategy for c in pool}))} allows the "
                         f"options given (mixed_precision needs a sharded strategy)")
    return usable


def _fixed(mesh: Mesh) -> bool:
    """Whether the mesh fixes more than the data-parallel axis (tp, pp, cp or ep > 1): then sw.parallelize builds
    it, and only its data-parallel strategy is chosen."""
    s = mesh.sizes
    return s["tp"] * s["pp"] * s["cp"] * s["ep"] > 1


def _on_mesh(mesh: Mesh, dp_strategy: str, shard: int | None = None) -> Candidate:
    s = mesh.sizes
    return Candidate("3d", dp_strategy, s["dp"], s["tp"], s["pp"], shard=shard, cp=s["cp"], ep=s["ep"])


def _decide(world: Communicator, mesh: Mesh | None, model: nn.Module, strategy: str, memory_gb: float | None,
            options: dict[str, Any]) -> Plan:
    work, allowed = _workload(model, options)
    node = options.get("devices_per_node")
    given: Candidate | None = None
    if strategy != "auto":  # checked on every rank before any collective, so a typo raises everywhere at once
        given = parse_strategy(strategy, world.size, shard_size=options.get("shard_size"), devices_per_node=node,
                               offload=_offload_level(options.get("cpu_offload")))
        if mesh is not None and given.kind == "dp" and _fixed(mesh):
            given = _on_mesh(mesh, given.dp_strategy, given.shard)
        if mesh is not None and given.kind == "tp" and mesh.sizes["tp"] != world.size:
            raise ValueError(f"distribute: strategy='tp' splits every layer over all {world.size} ranks, but the mesh "
                             f"given is {mesh!r}; name a data-parallel strategy (or 'auto') for the mesh's dp axis, or "
                             f"pass a mesh with tp={world.size}")
        s = mesh.sizes if mesh is not None else {}
        if given.kind == "3d" and mesh is not None and \
                (given.dp, given.cp, given.ep, given.tp, given.pp) != (s["dp"], s["cp"], s["ep"], s["tp"], s["pp"]):
            raise ValueError(f"distribute: strategy={strategy!r} does not match the mesh given ({mesh.sizes})")
    machine = probe(world, memory_gb)
    node = node or machine.devices_per_node
    seen = {"memory": machine.memory, "node": node, "device": machine.device}
    extra = {k: options[k] for k in ("intra_node_gbps", "inter_node_gbps", "fit_fraction") if k in options}

    def make_plan(facts: dict[str, Any]) -> Plan:
        links = Links(world.size, facts["node"], facts["memory"], **{**_host_links(facts["device"], extra), **extra})
        pool = _pool(world, mesh, facts["node"], facts["device"], allowed, options)
        if given is not None:
            return plan(work, links, strategy=given, pool=pool)
        return plan(work, links, pool=pool, **allowed)

    if world.rank == 0:
        try:
            answer = {**seen, "choice": make_plan(seen).candidate.label, "error": None}
        except ValueError as exc:
            answer = {**seen, "choice": None, "error": str(exc)}
    else:
        answer = None
    answer = broadcast_json(world, answer, src=0)
    if answer["error"]:
        raise ValueError(f"distribute: {answer['error']}")
    chosen = make_plan(answer)  # the same inputs on every rank give the same plan
    if chosen.candidate.label != answer["choice"]:  # would be a planner bug, never a silent divergence
        raise RuntimeError(f"distribute: rank {world.rank} planned {chosen.candidate.label!r}, rank 0 "
                           f"{answer['choice']!r}")
    return chosen


def _offload_level(value: object) -> str | None:
    """The planner's offload level for the wrappers' cpu_offload value, normalised as the engine does (True is
    "full"; an unknown value raises naming the levels); None for no offload."""
    level = offload_level(value)
    return None if level == "none" else level


def _pick(options: dict[str, Any], family: str) -> dict[str, Any]:
    return {k: v for k, v in options.items() if family in WRAPPER_OPTIONS.get(k, ())}


def _build(model: nn.Module, world: Communicator, mesh: Mesh | None, c: Candidate,
           options: dict[str, Any]) -> tuple[nn.Module, int, int, str]:
    comm = mesh.dp if mesh is not None else world
    if c.kind == "dp" and c.dp_strategy == "ddp":
        return DDP(model, comm, **_pick(options, "ddp")), comm.rank, comm.size, "ddp"
    if c.kind == "dp":
        family = "zero" if c.dp_strategy.startswith("zero") else "fsdp"
        kwargs = _pick(options, family)
        if c.offload and _offload_level(kwargs.get("cpu_offload")) != c.offload:  # chosen by the planner
            kwargs["cpu_offload"] = c.offload
        if family == "zero":
            return ZeRO(model, comm, stage=int(c.dp_strategy[-1]), **kwargs), comm.rank, comm.size, family
        kwargs.pop("shard_size", None)
        return FSDP(model, comm, sharding=c.dp_strategy.split(":")[1], shard_size=c.shard, **kwargs), comm.rank, \
            comm.size, family
    from . import tensor_parallel

    facts = model_facts(model)
    kwargs = _pick(options, "tp" if c.kind == "tp" else "3d")
    tp_plan = kwargs.pop("tp_plan", facts.tp_plan)
    if c.tp > 1 and tp_plan is None:
        raise ValueError(f"distribute: strategy={c.strategy!r} needs a tensor-parallel plan and "
                         f"{type(model).__name__} has no built-in one; pass tp_plan= (a dict of pattern -> style)")
    if c.kind == "tp":
        return tensor_parallel.parallelize(model, world, tp_plan, **kwargs), 0, 1, "tp"
    mesh = mesh or Mesh(world, dp=c.dp, cp=c.cp, ep=c.ep, tp=c.tp, pp=c.pp)
    if c.dp_strategy != "ddp":  # DDP's option: the sharded strategies leave unused parameters alone unasked
        kwargs.pop("find_unused_parameters", None)
    hybrid = parallelize(model, mesh, tp_plan=tp_plan if c.tp > 1 else None, dp_strategy=c.dp_strategy,
                         dp_shard=c.shard, **kwargs)
    return hybrid, mesh.coords.dp, mesh.sizes["dp"], "3d"


#: CPU ranks talk over gloo through the host: a 25 MiB all-reduce between 2 ranks on loopback moves ~1 GB/s on the
#: 2-core test machine (docs/benchmarks.md, DDP), two orders below the GPU links Links assumes by default.
CPU_GLOO_GBPS = 1.0


def _host_links(device: str, given: dict[str, Any]) -> dict[str, Any]:
    """The link figures for ranks on `device` the caller did not give (intra_node_gbps / inter_node_gbps options)."""
    named = {"intra_node_gbps", "inter_node_gbps"} & set(given)
    if device != "cpu" or len(named) == 2:
        return {"source": "as given" if named else "assumed GPU links: NVLink-class within a node, 100 Gb/s "
                                                   "between nodes"}
    return {"intra_node_gbps": CPU_GLOO_GBPS, "inter_node_gbps": CPU_GLOO_GBPS,
            "source": f"CPU ranks over gloo: ~{CPU_GLOO_GBPS:g} GB/s measured on loopback; pass intra_node_gbps= / "
                      f"inter_node_gbps= to plan for other links"}


def distribute(model: nn.Module, comm_or_mesh: Communicator | Mesh | None = None, strategy: str = "auto", *,
               memory_gb: float | None = None, **options: Any) -> nn.Module:
    """Distribute `model` over the ranks of `comm_or_mesh` (default `sw.init()`) with `strategy`; return the model
    ready for a plain loop (a HybridModel for "3d:..." layouts), with `model.plan` (see the module docstring).

    strategy: "auto" (the fastest layout that fits, by `shardwise.planner`), "ddp", "zero1", "zero2", "zero3",
        "fsdp" (= "fsdp:full_shard"), "fsdp:shard_grad_op", "fsdp:no_shard", "fsdp:hybrid_shard", "tp" or
        "3d:dp=A,tp=B,pp=C[,dp_strategy=S]" or "5d:dp=A,cp=B,ep=C,tp=D,pp=E[,dp_strategy=S]". With a Mesh whose
        tp, pp, cp or ep > 1, a data-parallel string (or "auto") chooses the strategy over its dp axis (DDP when
        ep > 1) and sw.parallelize builds the mesh's composition.
    memory_gb: memory per rank to plan for (GB of 10^9 bytes); default: what the devices report.
    options: for the planner, optimizer="adamw" (the one you will build: it sizes the optimizer state),
        seq_len and batch_size (sequences per rank per step: activations are counted), attention ("eager" or
        "fused"; default "fused" for the shardwise GPT), devices_per_node, intra_node_gbps, inter_node_gbps,
        fit_fraction, offload (False: never choose CPU offload); for the wrappers, their own options
        (mixed_precision, activation_checkpointing, cpu_offload, wrap, group_mb, prefetch, shard_size, bucket_mb,
        find_unused_parameters, broadcast_buffers, tp_plan, sequence_parallel, pp_schedule, n_microbatches,
        loss_fn, virtual_stages, cp_method), each passed to the wrapper it belongs to.
    Raises ValueError, naming the argument and what is allowed, for an unknown strategy or option, sizes that do
    not divide, or (auto) a model that fits no layout, with the smallest world size that would fit.
    Collective: every rank calls it with the same model and arguments.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"distribute: model must be a torch.nn.Module, got {type(model).__name__}")
    if layout.is_wrapped(model):
        applied = " + ".join(r.name for r in layout.strategies(model))
        raise ValueError(f"distribute: the model is already distributed ({applied}); pass the plain model")
    if not any(True for _ in model.parameters()):
        raise ValueError("distribute: the model has no parameters")
    if memory_gb is not None and (isinstance(memory_gb, bool) or not isinstance(memory_gb, (int, float))
                                  or not memory_gb > 0):
        raise ValueError(f"distribute: memory_gb={memory_gb!r} must be a positive number of GB per rank or None")
    _check_options(options)
    if comm_or_mesh is None:
        comm_or_mesh = init()
    if isinstance(comm_or_mesh, Mesh):
        mesh, world = comm_or_mesh, comm_or_mesh.world
    elif is_communicator(comm_or_mesh):
        mesh, world = None, comm_or_mesh
    else:
        raise ValueError(f"distribute: comm_or_mesh must be a shardwise Communicator, a Mesh or None (sw.init()), "
                         f"got {type(comm_or_mesh).__name__}")
    if "cpu_offload" in options and options["cpu_offload"] not in (None, False, True, "optimizer", "full"):
        raise ValueError(f"distribute: cpu_offload={options['cpu_offload']!r}; allowed None, False, True, "
                         f"'optimizer', 'full'")
    chosen = _decide(world, mesh, model, strategy, memory_gb, options)
    wrapped, data_rank, data_world, family = _build(model, world, mesh, chosen.candidate, options)
    unused = tuple(sorted(k for k in options if k in WRAPPER_OPTIONS and family not in WRAPPER_OPTIONS[k]))
    composition = wrapped.plan if isinstance(wrapped, HybridModel) else None
    wrapped.plan = Distribution(chosen, data_rank, data_world, unused, composition)
    if world.rank == 0:
        get_logger("shardwise.distribute").info("sw.distribute over %d ranks:\n%s", world.size, wrapped.plan.explain())
    return wrapped

