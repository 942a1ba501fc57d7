"""`ZeRO(module, comm, stage=...)` and `FSDP(module, comm_or_mesh, sharding=...)`: one engine, several configurations.

| name                          | parameters at rest | gradients | optimizer state | collectives per step (per unit)  |
|-------------------------------|--------------------|-----------|-----------------|----------------------------------|
| ZeRO stage 1                  | whole              | whole     | sharded         | reduce-scatter + all-gather      |
| ZeRO stage 2                  | whole              | sharded   | sharded         | reduce-scatter + all-gather      |
| ZeRO stage 3 / `full_shard`   | sharded            | sharded   | sharded         | 2 all-gathers + reduce-scatter   |
| `shard_grad_op`               | sharded (gathered from forward through backward) | sharded | sharded | all-gather + reduce-scatter |
| `no_shard`                    | whole              | whole     | whole           | all-reduce (as DDP)              |
| `hybrid_shard`                | sharded in a group, replicated across groups | ... | ... | full_shard in the group + all-reduce of the shard across groups |

Wire bytes per rank per step (ring, Ψ parameter bytes, N ranks): DDP / no_shard / stage 1 / stage 2 / shard_grad_op
2(N-1)/N Ψ; stage 3 / full_shard 3(N-1)/N Ψ (the 1.5x of the ZeRO paper).

An expert-parallel model (shardwise.experts) is wrapped over its dp group as a dense one: its expert slices, which
differ across dp, go into units of their own sharded over the ranks holding the same experts (edp), so the same
formulas hold per group (expert_units.py); hybrid_shard and compression are refused with them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

from torch import nn

from .. import layout
from .._mixin import MovesRefused, mix_in
from ..activation_checkpointing import check_interval
from ..batch_norm_split import apply_batch_norm_choice
from ..buffer_writes import check_buffer_writes_option, watch_buffer_writes
from ..embedding_rows import check_embedding_rows
from ..forward_methods import check_forward_methods, route_through_forward, with_generate
from ..batch_split import refuse_unsplittable_batch_statistics, share_batch_split
from ..agreement import check_agreement, describe_parameters
from ..comm.coalesced import broadcast_coalesced
from ..optimizer_guard import mark_replaced, register_wrapped
from ..compiled import refuse_compiled
from ..whole.state_dict import load_full_into_pieces
from ..placement import to_comm_device
from ..sharded_tensor import local
from ..comm.base import Communicator, is_communicator
from ..mesh import Mesh
from ..compression.base import Compressor
from ..compression.support import check_copies, check_supported
from .declare import engine_memory, sharded_placements
from .engine import ShardingEngine
from .expert_units import expert_family
from .offload import offload_level
from .policy import MixedPrecision, ShardingConfig

__all__ = ["ZeRO", "FSDP", "ShardedModule", "SHARDING_STRATEGIES"]

SHARDING_STRATEGIES = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard")

_STAGES = {
    1: dict(keep_full=True, reshard_after_forward=False, keep_grad_buffer=True),
    2: dict(keep_full=True, reshard_after_forward=False, keep_grad_buffer=False),
    3: dict(keep_full=False, reshard_after_forward=True, keep_grad_buffer=False),
}
_FSDP = {
    "full_shard": _STAGES[3],
    "hybrid_shard": _STAGES[3],
    "shard_grad_op": dict(keep_full=False, reshard_after_forward=False, keep_grad_buffer=False),
    "no_shard": dict(keep_full=True, reshard_after_forward=False, keep_grad_buffer=True),
}


class ShardedModule(MovesRefused):
    """Mixed into a module's class by ZeRO / FSDP: adds `no_sync()` and `sharding_units()`."""

    _sharding: ShardingEngine

    @property
    def require_backward_grad_sync(self) -> bool:
        """torch DDP's flag, the one `no_sync()` sets: False makes backward accumulate unsharded gradients locally
        (nanoGPT sets it to `micro_step == last` instead of entering no_sync)."""
        return self._sharding.require_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._sharding.require_sync = bool(value)

    def sync_gradients(self) -> None:
        """Reduce, now, the gradients backward passes under `no_sync()` accumulated (collective)."""
        self._sharding.sync_gradients()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate unsharded gradients locally; the next one outside reduces the sum."""
        engine = self._sharding
        previous = engine.require_sync
        engine.require_sync = False
        try:
            yield
        finally:
            engine.require_sync = previous

    def sharding_units(self) -> list[dict[str, Any]]:
        """The units in creation order (the root unit last): name, parameters, tensors, padded size, shard size,
        the used flags each rank's chunk of the gradient reduction carries (one per trainable tensor; 0 under
        compression, which all-reduces them apart) and the reduced buffer's elements (padded + ranks x flags)."""
        return [
            {"unit": u.name, "params": u.numel, "tensors": len(u.infos), "padded": u.padded, "shard": u.shard_size,
             "flags": u.grad_layout.band, "grad_buffer": u.grad_layout.numel}
            for u in self._sharding.units
        ]

    @property
    def compressor(self) -> Compressor | None:
        """This rank's gradient compressor (its error-feedback state: `state_dict()`), or None."""
        return self._sharding.compressor


def _check_common(module: nn.Module, comm: Any, mixed_precision: Any, cpu_offload: Any, group_mb: Any,
                  flags: dict[str, Any]) -> MixedPrecision:
    if not isinstance(module, nn.Module):
        raise ValueError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    refuse_compiled(module, "sw.ZeRO / sw.FSDP")
    if not is_communicator(comm):
        raise ValueError(f"comm must be a shardwise Communicator (sw.init(), sw.launch's argument, mesh.dp), got "
                         f"{type(comm).__name__}")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r} must be True or False")
    layout.check_not_data_parallel(module, "ZeRO/FSDP")
    if not any(True for _ in module.parameters()):
        raise ValueError("the module has no parameters to shard")
    if mixed_precision is None:
        mixed_precision = MixedPrecision()
    if not isinstance(mixed_precision, MixedPrecision):
        raise ValueError(f"mixed_precision={mixed_precision!r} must be a shardwise.MixedPrecision or None")
    offload_level(cpu_offload)  # raises naming the allowed levels
    if group_mb is not None and (isinstance(group_mb, bool) or not isinstance(group_mb, (int, float))
                                 or not group_mb > 0):
        raise ValueError(f"group_mb={group_mb!r} must be a positive number of MiB or None (chosen from the model)")
    return mixed_precision


def _check_inflight(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"max_inflight_reductions={value!r} must be a positive int")
    return value


def _check_replicated(module: nn.Module, params: object) -> tuple[nn.Parameter, ...]:
    params = tuple(params)  # type: ignore[arg-type]
    own = {id(p) for p in module.parameters()}
    stray = [i for i, p in enumerate(params) if not isinstance(p, nn.Parameter) or id(p) not in own]
    if stray:
        raise ValueError(f"replicated_params: entries {stray} are not parameters of the module being wrapped")
    return params


def _wrap(module: nn.Module, comm: Communicator, shard: Communicator, replicate: Communicator | None,
          config: ShardingConfig, record_name: str, replicated_params: tuple[nn.Parameter, ...],
          batch_norm: str | None, buffer_writes: str | None, forward_methods: Any = None) -> nn.Module:
    # The model lives where the collectives run (this rank's GPU under NCCL); master shards go back to CPU only
    # with cpu_offload. Every rank wraps the same model with the same options, and starts from rank 0's values.
    refuse_unsplittable_batch_statistics(module, comm, record_name)
    apply_batch_norm_choice(module, comm, batch_norm, record_name)
    check_buffer_writes_option(buffer_writes, record_name)
    methods = with_generate(module, check_forward_methods(module, forward_methods, record_name))
    # An in-place write in forward reaches the master where the whole parameters kept between steps are its storage.
    check_embedding_rows(module, comm, record_name, lambda dtype: config.keep_full and config.cpu_offload == "none"
                         and config.mixed_precision.param_dtype in (None, dtype), sparse_alone=True)
    to_comm_device(module, comm, record_name)
    # Expert-parallel slices differ across comm: their own units, over the ranks holding the same experts.
    experts = expert_family(module, comm, shard, "ZeRO/FSDP", config.compression)
    stray = [i for i, p in enumerate(replicated_params) if p in experts.params]
    if stray:
        raise ValueError(f"ZeRO/FSDP: replicated_params entries {stray} are expert-parallel slices, which differ "
                         f"across the data-parallel ranks and cannot be averaged over all of them; leave them out")
    check_agreement(comm, record_name, {"parameters": describe_parameters(module), "options": {
        "batch_norm": str(batch_norm), "buffer_writes": str(buffer_writes), "forward_methods": str(methods),
        **{k: str(v) for k, v in dataclasses.asdict(config).items()}}})
    if comm.size > 1:
        broadcast_coalesced(comm, [local(p.data) for p in module.parameters() if p not in experts.params]
                            + [b.data for b in module.buffers()])
    if experts.replicas is not None and experts.replicas.size > 1:
        broadcast_coalesced(experts.replicas, [local(p.data) for p in module.parameters() if p in experts.params])
    # The placements so far (plain, or tensor parallel), keyed by this module's own parameter names.
    own_names = {id(p): name for name, p in module.named_parameters()}
    before = {own_names[id(pl.param)]: pl for pl in layout.placements(module).values()}
    # Weights tied to copies on other pipeline ranks stay whole, so the pipeline can sum the copies' gradients.
    tied = tuple(pl.param for pl in before.values() if pl.tied_over is not None and pl.param not in replicated_params)
    originals = list(module.parameters())
    engine = ShardingEngine(module, comm, shard, replicate, config, (*replicated_params, *tied), experts)
    kept = {id(p) for p in module.parameters()}
    mark_replaced([p for p in originals if id(p) not in kept], record_name)
    route_through_forward(module, methods)  # below ShardedModule's class, as under DDP
    mix_in(module, ShardedModule, "Sharded")
    module._sharding = engine
    comms = (shard,) if replicate is None else (shard, replicate)
    layout.declare(module, layout.Parallelized(
        record_name, comms, sharded_placements(engine, before), no_sync=module.no_sync, world=comm,
        memory=lambda: engine_memory(engine), options={"sharding": config.name},
        before_step=lambda held: _refuse_unreduced(engine, record_name),
        extra_state=() if engine.compressor is None else (engine.compressor.extra_state(
            comm, sharding=config.name, units=len(engine.units), shard=shard.size,
            replicate=None if replicate is None else replicate.size),)))
    watch_buffer_writes(module, comm, buffer_writes, record_name)
    share_batch_split(module, comm, record_name)  # a MoE layer's balance loss over the global batch (batch_split.py)
    register_wrapped(module)
    load_full_into_pieces(module)  # torch's load_state_dict of a full (one-process) state dict: each rank's piece
    return module


def _refuse_unreduced(engine: ShardingEngine, name: str) -> None:
    """Before an optimizer step: the last backward passes ran under `no_sync()` (or with
    require_backward_grad_sync=False) and nothing reduced them since, so no rank's pieces hold their gradient: the
    step would skip it (or step on last step's), silently. RuntimeError naming what to do."""
    if engine.accumulating:
        raise RuntimeError(f"optimizer.step(): {name}'s gradients of the backward passes since the last step ran "
                           f"under no_sync() (or require_backward_grad_sync=False) and were never reduced over the "
                           f"ranks, so the pieces the optimizer steps do not hold them; run the last micro-batch's "
                           f"backward outside no_sync() (require_backward_grad_sync = True for it), or call "
                           f"model.sync_gradients() before the step")


def ZeRO(
    module: nn.Module,
    comm: Communicator,
    *,
    stage: int,
    mixed_precision: MixedPrecision | None = None,
    cpu_offload: bool | str = False,
    wrap: object = "auto",
    group_mb: float | None = None,
    activation_checkpointing: bool | int = False,
    prefetch: bool = True,
    replicated_params: tuple[nn.Parameter, ...] = (),
    max_inflight_reductions: int = 2,
    compression: Compressor | None = None,
    batch_norm: str | None = None,
    buffer_writes: str | None = None,
    forward_methods: tuple[str, ...] | None = None,
) -> nn.Module:
    """ZeRO data parallelism (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
    Models", SC 2020) over `comm`; returns the same module.

    stage: 1 shards optimizer state; 2 also gradients (reduce-scattered during backward); 3 also parameters
        (all-gathered before each unit's forward and again in its backward, freed after each).
    mixed_precision: dtypes of compute copies and reductions (fp32 master shards are kept).
    cpu_offload: which model states live in host memory (`sharding.offload`): "optimizer" (master shards, their
        gradients and so the optimizer state; the optimizer steps there), "full" (also no parameters kept on the
        device: ZeRO-3 copies the host master in at each gather), True (= "full"), False (nothing).
    wrap / group_mb: how parameters are grouped into communication units (see `sharding.policy`); group_mb=None
        lets wrap="auto" pick the size from the model (about 1/8 of it, within 2..25 MiB).
    activation_checkpointing: recompute units' activations in backward (torch.utils.checkpoint): True for every
        unit, an int k for every k-th unit (the design documents' CheckpointInterval), False for none.
    prefetch: issue the next unit's all-gather while the current one computes.
    replicated_params: parameters kept whole on every rank and all-reduced (averaged) as DDP does, in no unit
        (e.g. a weight tied across pipeline stages, whose copies are summed before the data-parallel average).
    max_inflight_reductions: gradient reduce-scatters in flight during backward; one more finishes the oldest and
        frees its flat buffer, bounding unsharded gradient memory (memory_stats().grad_buffer_peak).
    compression: a `sw.compression` method: FP16() / BF16() (any stage; stage 3 without error_feedback) keep the
        reduce-scatter, in 16 bits and the method's rounding; TopK, RandomK, PowerSGD, OneBit (stage 1/2) replace
        each unit's reduce-scatter by a compressed all-reduce, after which each rank keeps its shard
        (docs/compression.md).
    batch_norm: "sync" (BatchNorm layers become sw.SyncBatchNorm over `comm`: the global batch's statistics),
        "local" (each rank's own, torch DDP's), None (default: a forward that would use per-rank batch statistics
        raises, naming the layer; batch_norm_split.py).
    buffer_writes: None (default: a buffer that a training forward leaves different across the ranks, such as a
        running statistic of each rank's slice, raises, naming it) or "local" (each rank's own; buffer_writes.py).
    forward_methods: names of the model's methods that compute like its forward and are called instead of it
        (CLIP's "encode_image", a VAE's "encode"): each runs as the forward, its parameters gathered
        (forward_methods.py, FSDP2's register_fsdp_forward_method).
    After wrapping, `module.named_parameters()` yields each original name with this rank's shard (a 1-D, possibly
    empty nn.Parameter): build any torch.optim optimizer over `module.parameters()` after wrapping.
    """
    if isinstance(stage, bool) or stage not in _STAGES:
        raise ValueError(f"ZeRO: stage={stage!r} is not supported; allowed 1, 2 or 3")
    mp = _check_common(module, comm, mixed_precision, cpu_offload, group_mb,
                       {"prefetch": prefetch})
    check_supported(compression, f"zero{stage}", reduce_dtype=mp.reduce_dtype)
    check_copies(module, compression, f"ZeRO stage {stage}")
    config = ShardingConfig(f"zero{stage}", **_STAGES[stage], mixed_precision=mp, wrap=wrap,
                            cpu_offload=offload_level(cpu_offload), group_mb=group_mb, prefetch=prefetch,
                            activation_checkpointing=check_interval(activation_checkpointing, "ZeRO/FSDP"),
                            max_inflight_reductions=_check_inflight(max_inflight_reductions),
                            compression=compression)
    return _wrap(module, comm, comm, None, config, f"zero{stage}", _check_replicated(module, replicated_params),
                 batch_norm, buffer_writes, forward_methods)


def FSDP(
    module: nn.Module,
    comm_or_mesh: Communicator | Mesh,
    *,
    sharding: str = "full_shard",
    shard_size: int | None = None,
    mixed_precision: MixedPrecision | None = None,
    cpu_offload: bool | str = False,
    wrap: object = "auto",
    group_mb: float | None = None,
    activation_checkpointing: bool | int = False,
    prefetch: bool = True,
    replicated_params: tuple[nn.Parameter, ...] = (),
    max_inflight_reductions: int = 2,
    compression: Compressor | None = None,
    batch_norm: str | None = None,
    buffer_writes: str | None = None,
    forward_methods: tuple[str, ...] | None = None,
) -> nn.Module:
    """Fully sharded data parallelism (Zhao et al., "PyTorch FSDP", VLDB 2023) with PyTorch's strategy names.

    comm_or_mesh: a Communicator, or a Mesh whose dp axis is used.
    sharding: "full_shard" (= ZeRO-3), "shard_grad_op" (parameters gathered once per step, kept from forward
        through backward), "no_shard" (= DDP), "hybrid_shard" (full_shard inside groups of `shard_size`
        consecutive ranks, replicated across the groups: gradients are reduce-scattered in the group, then
        all-reduced across groups).
    compression: a `sw.compression` method for no_shard (any) and the replicate axis of hybrid_shard (PowerSGD
        only with shard_size=1); with full_shard / shard_grad_op only FP16() / BF16() without error feedback, as a
        16-bit reduce-scatter (docs/compression.md).
    The other options are those of `ZeRO`.
    """
    comm = comm_or_mesh.dp if isinstance(comm_or_mesh, Mesh) else comm_or_mesh
    if not is_communicator(comm):
        raise ValueError(f"FSDP: comm_or_mesh must be a shardwise Communicator or Mesh, got {type(comm).__name__}")
    if sharding not in _FSDP:
        raise ValueError(f"FSDP: sharding={sharding!r} is not supported; allowed {SHARDING_STRATEGIES}")
    if sharding == "hybrid_shard":
        if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1 or comm.size % shard_size:
            raise ValueError(
                f"FSDP: hybrid_shard needs shard_size, a positive int dividing the {comm.size} data-parallel ranks; "
                f"got shard_size={shard_size!r}"
            )
    elif shard_size is not None:
        raise ValueError(f"FSDP: shard_size={shard_size!r} only applies to sharding='hybrid_shard'")
    mp = _check_common(module, comm, mixed_precision, cpu_offload, group_mb,
                       {"prefetch": prefetch})
    replicated_params = _check_replicated(module, replicated_params)
    check_supported(compression, sharding, reduce_dtype=mp.reduce_dtype, shard_size=shard_size or 1,
                    replicas=comm.size // shard_size if sharding == "hybrid_shard" else None)
    check_copies(module, compression, f"FSDP({sharding})")
    config = ShardingConfig(sharding, **_FSDP[sharding], mixed_precision=mp, wrap=wrap,
                            cpu_offload=offload_level(cpu_offload), group_mb=group_mb, prefetch=prefetch,
                            activation_checkpointing=check_interval(activation_checkpointing, "ZeRO/FSDP"),
                            max_inflight_reductions=_check_inflight(max_inflight_reductions),
                            compression=compression)
    if sharding == "no_shard":
        return _wrap(module, comm, comm.split(comm.rank), comm, config, "fsdp:no_shard", replicated_params,
                     batch_norm, buffer_writes, forward_methods)
    if sharding == "hybrid_shard":
        shard = comm.split(comm.rank // shard_size)
        replicate = comm.split(comm.rank % shard_size)
        return _wrap(module, comm, shard, replicate, config, "fsdp:hybrid_shard", replicated_params, batch_norm,
                     buffer_writes, forward_methods)
    return _wrap(module, comm, comm, None, config, f"fsdp:{sharding}", replicated_params, batch_norm, buffer_writes,
                 forward_methods)
