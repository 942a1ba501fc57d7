"""The strategy a check runs: a string, a mesh dict or a callable, parsed once into a `Spec` that wraps a model.

Parsing happens before any rank starts, so a typo raises ValueError in the caller's thread naming the value and
what is allowed. `Spec.wrap(model, comm)` then runs on every rank and applies the strategy the documented way:
tensor parallel first (`tp.parallelize` over `mesh.tp`), then the data-parallel wrapper over `mesh.dp`, the
optimizer last; a mesh with pipeline stages (pp > 1) goes through `sw.parallelize`, which applies every axis in
torchtitan's order. A Spec is plain data (and the user's callable), so it pickles to gloo processes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torch import nn

from ..comm.base import Communicator

__all__ = ["Spec", "parse_strategy", "STRATEGIES", "DP_STRATEGIES", "MESH_KEYS", "TP_PLANS"]

#: Data-parallel strategies, alone (over the whole world) or as a mesh's "dp_strategy" (over mesh.dp).
DP_STRATEGIES = ("ddp", "ddp:find_unused", "zero1", "zero2", "zero3", "fsdp", "fsdp:full_shard",
                 "fsdp:shard_grad_op", "fsdp:no_shard", "fsdp:hybrid_shard")
#: Built-in tensor-parallel plans ("tp:<plan>"; "tp" alone takes the model's own, as sw.distribute does).
TP_PLANS = ("gpt", "gpt2", "llama", "hf")
#: Every strategy string `check` accepts.
STRATEGIES = ("none", *DP_STRATEGIES, "distribute", "tp", *(f"tp:{p}" for p in TP_PLANS))
#: Keys of a mesh dict: {"tp": 2, "tp_plan": "llama", "dp_strategy": "zero3", "sequence_parallel": False, "ep": 2},
#: {"pp": 2, "pp_schedule": "1f1b", "n_microbatches": 4} (pipelines: through sw.parallelize).
MESH_KEYS = ("tp", "tp_plan", "dp_strategy", "sequence_parallel", "dp_shard", "pp", "dp", "ep", "cp", "cp_method",
             "pp_schedule", "n_microbatches", "virtual_stages", "activation_checkpointing")
#: The data-parallel strategies sw.parallelize applies to pipeline stages, as the check names them.
PIPELINE_DP_STRATEGIES = {"ddp": "ddp", "ddp:find_unused": "ddp", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3",
                          "fsdp": "fsdp:full_shard", "fsdp:full_shard": "fsdp:full_shard",
                          "fsdp:shard_grad_op": "fsdp:shard_grad_op", "fsdp:hybrid_shard": "fsdp:hybrid_shard"}


@dataclasses.dataclass(frozen=True)
class Spec:
    """A parsed strategy. label: how the report names it. world_size: ranks to launch. kind: "none", "dp", "tp",
    "mesh", "distribute" or "callable". dp_strategy: one of DP_STRATEGIES (or None). tp: tensor-parallel size.
    tp_plan: a plan name or dict (None: the model's built-in one). dp_shard: hybrid_shard's shard group size.
    ep: expert-parallel size (experts split over ep ranks of dp, `shardwise.experts.expert_parallel`). cp, cp_method:
    context-parallel size and method (every sequence split over cp ranks, `shardwise.context_parallel.apply`).
    pp, pp_schedule, n_microbatches, virtual_stages, activation_checkpointing: pipeline stages, their schedule and
    sw.parallelize's activation checkpointing of the layers (pp > 1: `sw.parallelize` builds the whole mesh).
    wrapper: the user's `(model, comm) -> model`."""

    label: str
    world_size: int
    kind: str
    dp_strategy: str | None = None
    tp: int = 1
    tp_plan: Any = None
    sequence_parallel: bool = False
    dp_shard: int | None = None
    ep: int = 1
    cp: int = 1
    cp_method: str = "ring"
    pp: int = 1
    pp_schedule: str = "1f1b"
    n_microbatches: int | None = None
    virtual_stages: int = 1
    activation_checkpointing: bool | int = False
    wrapper: Callable[[nn.Module, Communicator], nn.Module] | None = None

    @property
    def dp(self) -> int | None:
        """The data-parallel size, when the strategy fixes it before wrapping (None: read from the layout)."""
        if self.kind in ("callable", "distribute"):
            return None
        return self.world_size // (self.tp * self.cp * self.pp) if self.dp_strategy is not None else 1

    def mesh(self, comm: Communicator) -> Any:
        """The Mesh a "mesh" strategy runs on (collective over `comm`)."""
        from ..mesh import Mesh

        return Mesh(comm, dp=None, tp=self.tp, ep=self.ep, cp=self.cp, pp=self.pp)

    def wrap(self, model: nn.Module, comm: Communicator, mesh: Any = None) -> nn.Module:
        """Apply the strategy to this rank's fresh model (collective over `comm`; a "mesh" strategy on `mesh`, made
        here when not given); return the model to train."""
        if self.kind == "none":
            return model
        if self.kind == "callable":
            wrapped = self.wrapper(model, comm)  # type: ignore[misc]
            if not isinstance(wrapped, nn.Module):
                raise ValueError(f"check: the strategy callable {self.label} returned {type(wrapped).__name__}; it "
                                 f"must return the wrapped torch.nn.Module")
            return wrapped
        if self.kind == "distribute":
            from ..distribute import distribute

            return distribute(model, comm)
        if self.kind == "dp":
            return _wrap_dp(model, comm, self.dp_strategy, self.dp_shard)
        from .. import tensor_parallel as tp

        mesh = mesh if mesh is not None else self.mesh(comm)
        if self.pp > 1:
            return self._parallelize(model, mesh)
        if self.tp > 1 or self.kind == "tp":
            plan = self.tp_plan if self.tp_plan is not None else _model_plan(model)
            model = tp.parallelize(model, mesh.tp, plan, sequence_parallel=self.sequence_parallel)
        if self.cp > 1:
            from .. import context_parallel

            model = context_parallel.apply(model, mesh.cp, method=self.cp_method)
        if self.ep > 1:  # sw.parallelize's order: tensor parallel, experts over ep, then the data-parallel wrapper
            from ..experts import expert_parallel

            model = expert_parallel(model, mesh)
        if self.dp_strategy is None:
            return model
        return _wrap_dp(model, mesh.dp_cp if self.cp > 1 else mesh.dp, self.dp_strategy, self.dp_shard)


    def _parallelize(self, model: nn.Module, mesh: Any) -> nn.Module:
        """Every axis of the mesh through `sw.parallelize` (pipelines run their loss inside the schedule: the check
        trains the result with `step`, check/run.py)."""
        from ..hybrid import parallelize

        plan = (self.tp_plan if self.tp_plan is not None else _model_plan(model)) if self.tp > 1 else None
        return parallelize(model, mesh, tp_plan=plan, sequence_parallel=self.sequence_parallel,
                           pp_schedule=self.pp_schedule, n_microbatches=self.n_microbatches,
                           virtual_stages=self.virtual_stages,
                           dp_strategy=PIPELINE_DP_STRATEGIES[self.dp_strategy or "ddp"],
                           find_unused_parameters=self.dp_strategy == "ddp:find_unused", dp_shard=self.dp_shard,
                           cp_method=self.cp_method, activation_checkpointing=self.activation_checkpointing)


def _model_plan(model: nn.Module) -> Any:
    from ..planner import model_facts

    plan = model_facts(model).tp_plan
    if plan is None:
        raise ValueError(f"check: {type(model).__name__} has no built-in tensor-parallel plan; name one "
                         f"(strategy='tp:llama', or a dict with 'tp_plan': {list(TP_PLANS)} or a dict of module-name "
                         f"pattern -> style)")
    return plan


def _wrap_dp(model: nn.Module, comm: Communicator, name: str | None, shard: int | None) -> nn.Module:
    from ..ddp import DDP
    from ..sharding import FSDP, ZeRO

    if name in ("ddp", "ddp:find_unused"):
        return DDP(model, comm, find_unused_parameters=name == "ddp:find_unused")
    if name is not None and name.startswith("zero"):
        return ZeRO(model, comm, stage=int(name[-1]))
    sharding = "full_shard" if name == "fsdp" else str(name).split(":", 1)[1]
    return FSDP(model, comm, sharding=sharding, shard_size=shard if sharding == "hybrid_shard" else None)


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"check: {name}={value!r} must be a positive int")
    return value


def _hybrid_shard(dp: int, given: object, where: str) -> int:
    """hybrid_shard's shard group size: `given`, or half the data-parallel ranks (which must be even and >= 4, so
    that there are at least two groups of at least two)."""
    if given is not None:
        shard = _positive_int("dp_shard", given)
        if dp % shard:
            raise ValueError(f"check: dp_shard={shard} must divide the {dp} data-parallel ranks")
        return shard
    if dp < 4 or dp % 2:
        raise ValueError(f"check: {where}='fsdp:hybrid_shard' shards over half the data-parallel ranks and "
                         f"replicates over the two halves: it needs an even data-parallel size of at least 4, got "
                         f"{dp}")
    return dp // 2


def _parse_mesh(strategy: dict[str, Any], world_size: int) -> Spec:
    unknown = sorted(set(strategy) - set(MESH_KEYS), key=str)
    if unknown:
        raise ValueError(f"check: unknown key(s) {unknown} in the strategy dict; allowed {list(MESH_KEYS)}")
    tp, cp = _positive_int("tp", strategy.get("tp", 1)), _positive_int("cp", strategy.get("cp", 1))
    pp = _positive_int("pp", strategy.get("pp", 1))
    pipeline = _pipeline_options(strategy, pp)
    sizes, axes = f"tp={tp} x cp={cp}" + (f" x pp={pp}" if pp > 1 else ""), "tp x cp" + (" x pp" if pp > 1 else "")
    if world_size % (tp * cp * pp):
        raise ValueError(f"check: {sizes} does not divide world_size={world_size}")
    dp = world_size // (tp * cp * pp)
    if strategy.get("dp", dp) != dp:
        raise ValueError(f"check: dp={strategy['dp']!r} but world_size // ({axes}) = {world_size} // {tp * cp * pp} "
                         f"= {dp}")
    method = strategy.get("cp_method", "ring")
    if method not in ("ring", "ulysses"):
        raise ValueError(f"check: cp_method={method!r} is not supported; allowed ['ring', 'ulysses']")
    dp_strategy = strategy.get("dp_strategy", "ddp" if dp * cp > 1 else None)
    if dp_strategy in (None, "none"):
        if dp * cp > 1:  # context parallel's gradients are averaged over dp x cp by the data-parallel wrapper
            raise ValueError(f"check: the mesh has dp={dp} x cp={cp} (world_size {world_size} / tp {tp}); name "
                             f"dp_strategy, one of {list(DP_STRATEGIES)}")
        dp_strategy = None
    elif dp_strategy not in DP_STRATEGIES:
        raise ValueError(f"check: dp_strategy={dp_strategy!r} is not supported; allowed {list(DP_STRATEGIES)}")
    elif pp > 1 and dp_strategy not in PIPELINE_DP_STRATEGIES:
        raise ValueError(f"check: dp_strategy={dp_strategy!r} does not apply to pipeline stages (pp={pp}); allowed "
                         f"{list(PIPELINE_DP_STRATEGIES)}")
    shard = _hybrid_shard(dp * cp, strategy.get("dp_shard"), "dp_strategy") if dp_strategy == "fsdp:hybrid_shard" \
        else None
    if shard is None and strategy.get("dp_shard") is not None:
        raise ValueError("check: dp_shard only applies to dp_strategy='fsdp:hybrid_shard'")
    ep = _positive_int("ep", strategy.get("ep", 1))
    if (dp * cp) % ep:
        raise ValueError(f"check: ep={ep} must divide the {dp * cp} data-parallel ranks (expert parallel splits the "
                         f"experts over ep of them)")
    sp = strategy.get("sequence_parallel", False)
    if not isinstance(sp, bool):
        raise ValueError(f"check: sequence_parallel={sp!r} must be True or False")
    plan = strategy.get("tp_plan")
    if plan is not None and not isinstance(plan, (str, dict)):
        raise ValueError(f"check: tp_plan={plan!r} must be a plan name {list(TP_PLANS)} or a dict")
    shown = plan if isinstance(plan, str) else "dict" if plan is not None else "the model's"
    parts = [f"tp={tp} (plan {shown}{', sequence parallel' if sp else ''})"] if tp > 1 or ep == cp == pp == 1 else []
    if pp > 1:
        parts.append(f"pp={pp} ({pipeline['pp_schedule']}"
                     + (f", {pipeline['virtual_stages']} stages per rank" if pipeline["virtual_stages"] > 1 else "")
                     + (f", {pipeline['n_microbatches']} microbatches" if pipeline["n_microbatches"] else "")
                     + (", activation checkpointing" if pipeline["activation_checkpointing"] else "") + ")")
    if cp > 1:
        parts.append(f"cp={cp} ({method} attention)")
    if ep > 1:
        parts.append(f"experts over ep={ep}")
    if dp_strategy is not None:
        parts.append(f"{dp_strategy} over dp={dp}" + (f" x cp={cp}" if cp > 1 else ""))
    label = " x ".join(parts)
    return Spec(label, world_size, "mesh", dp_strategy, tp, plan, sp, shard, ep, cp, method, pp, **pipeline)


def _pipeline_options(strategy: dict[str, Any], pp: int) -> dict[str, Any]:
    """The schedule keys of a mesh dict (pp > 1 only; sw.parallelize checks their values)."""
    given = {k: strategy[k] for k in ("pp_schedule", "n_microbatches", "virtual_stages", "activation_checkpointing")
             if k in strategy}
    if given and pp == 1:
        raise ValueError(f"check: {sorted(given)} only apply to pipelines (pp > 1), got pp=1")
    if "n_microbatches" in given:
        _positive_int("n_microbatches", given["n_microbatches"])
    if "virtual_stages" in given:
        _positive_int("virtual_stages", given["virtual_stages"])
    if not isinstance(given.get("pp_schedule", ""), str):
        raise ValueError(f"check: pp_schedule={given['pp_schedule']!r} must be a schedule name")
    return {"pp_schedule": "1f1b", "n_microbatches": None, "virtual_stages": 1, "activation_checkpointing": False,
            **given}


def parse_strategy(strategy: object, world_size: object) -> Spec:
    """The Spec of `strategy` on `world_size` ranks, or ValueError naming the value and what is allowed."""
    world_size = _positive_int("world_size", world_size)
    if callable(strategy) and not isinstance(strategy, (str, dict)):
        name = getattr(strategy, "__qualname__", None) or type(strategy).__name__
        return Spec(f"callable {name}", world_size, "callable", wrapper=strategy)  # type: ignore[arg-type]
    if isinstance(strategy, dict):
        return _parse_mesh(strategy, world_size)
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise ValueError(f"check: strategy={strategy!r} is not supported; allowed {list(STRATEGIES)}, a dict "
                         f"{{'tp': 2, 'tp_plan': 'llama', 'dp_strategy': 'zero3'}} (keys {list(MESH_KEYS)}), or a "
                         f"callable (model, comm) -> wrapped model")
    if strategy == "none":
        return Spec("none (one rank)", 1, "none")
    if strategy == "distribute":
        return Spec("distribute (sw.distribute, strategy='auto')", world_size, "distribute")
    if strategy.startswith("tp"):
        plan = strategy.split(":", 1)[1] if ":" in strategy else None
        return Spec(strategy, world_size, "tp", None, world_size, plan)
    shard = _hybrid_shard(world_size, None, "strategy") if strategy == "fsdp:hybrid_shard" else None
    return Spec(strategy, world_size, "dp", strategy, dp_shard=shard)
