"""Policies of the sharding engine: mixed precision, what each strategy keeps and frees (`ShardingConfig`), and the
wrap policy that groups parameters into units.

A *unit* is the granularity of communication: its parameters live in one flat buffer that is all-gathered with ONE
collective and whose gradients are reduce-scattered with ONE collective. Units are chosen by a wrap policy:

* `wrap="auto"` (default): walk the module tree; every module whose subtree holds at least `group_mb` of
  parameters becomes its own unit if it is a natural repeating block (a child of a ModuleList / Sequential);
  runs of consecutive small siblings are merged until they reach `group_mb`. `group_mb=None` (the default) picks it
  from the model: about 1/8 of its parameter bytes, within [2 MiB, 25 MiB] (`auto_group_mb`). A model of 1,000
  tiny layers thus needs a handful of collectives per pass, not 1,000 (the grouping PyTorch FSDP's size-based
  policy only does for whole subtrees, and DeepSpeed's bucketing does for communication only).
* `wrap=<module class or tuple of classes>`: every instance of those classes is a unit (e.g. the GPT Block).
* `wrap="size:<MB>"`: every module whose subtree holds >= MB of parameters not already in a unit becomes one.
* `wrap=None`: one unit for the whole model.
No unit is bracketed by a module without a forward of its own (ModuleList, ModuleDict, ParameterList: containers
nothing calls, whose hooks would never fire): a run looks through them to the blocks they hold, and their own
parameters stay with the unit of the module that reads them. Parameters not claimed by any unit belong to the root
unit. A parameter shared by modules of different units (tied weights) is moved to the root unit so it is gathered
once and its gradient summed once. A unit is one dtype: inside a unit that would mix dtypes, the modules holding
another dtype become units of their own (`_split_by_dtype`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from ..sharded_tensor import local  # a tensor-parallel slice holds its own bytes, not the dense tensor's

__all__ = ["MixedPrecision", "ShardingConfig", "plan_units"]

MB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """Dtypes of the sharding engine (Micikevicius et al. 2018, "Mixed Precision Training").

    param_dtype: dtype of the gathered compute copies of the parameters (None: the parameter's own dtype). The
        master shards stay in fp32 and the optimizer updates them.
    reduce_dtype: dtype in which gradients are reduce-scattered / all-reduced (None: param_dtype, else fp32),
        rounding to nearest as torch FSDP does. For a bf16 reduction prefer `compression=sw.compression.BF16()`
        (ZeRO / FSDP take it as a 16-bit reduce-scatter, same bytes, rounded stochastically: bf16 to nearest cost
        the demo GPT up to +5.6% of final loss, docs/compression.md).
    buffer_dtype: dtype buffers (e.g. BatchNorm statistics) are cast to at wrap time (None: unchanged).
    With param_dtype=torch.float16, use `ShardedGradScaler` to scale the loss and skip steps with inf/nan.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
                raise ValueError(f"MixedPrecision: {field}={value!r} must be a floating torch.dtype or None")


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """What the engine shards and when (see the strategy table in docs/sharding.md).

    keep_full: the gathered parameters stay allocated between steps (ZeRO-1/2, no_shard).
    reshard_after_forward: free the gathered parameters after each unit's forward (stage 3, full/hybrid shard).
    keep_grad_buffer: full-size gradient buffers stay allocated (ZeRO-1, no_shard: gradients are not sharded).
    max_inflight_reductions: reduce-scatters allowed in flight during backward; launching one more finishes the
        oldest (its shard goes to .grad and its flat buffer is freed), so ZeRO-2/3 never hold a whole unsharded
        gradient: at most this many units' buffers plus the one accumulating (FSDP2 keeps one in flight).
    compression: a `sw.compression` method for the data-parallel gradient reduction (which strategies accept which
        method: compression/support.py), or None.
    """

    name: str
    keep_full: bool
    reshard_after_forward: bool
    keep_grad_buffer: bool
    mixed_precision: MixedPrecision = MixedPrecision()
    cpu_offload: str = "none"  # an offload level (sharding.offload): "none", "optimizer" or "full"
    wrap: object = "auto"
    group_mb: float | None = None
    prefetch: bool = True
    activation_checkpointing: int = 0
    max_inflight_reductions: int = 2
    compression: Any = None


@dataclasses.dataclass
class UnitPlan:
    """The modules whose forward brackets a unit, and its parameters as (module, attribute name) locations."""

    name: str
    modules: list[nn.Module]
    params: list[nn.Parameter]
    locations: dict[nn.Parameter, list[tuple[nn.Module, str]]]
    is_root: bool = False


def _has_forward(module: nn.Module) -> bool:
    """Whether the module can be called: a container (ModuleList, ModuleDict, ParameterList) defines no forward, nor
    can a Sequential holding one run its own, so nothing calls them and a unit bracketed by one would never be
    gathered."""
    if type(module).forward is nn.Module.forward:
        return False
    return type(module).forward is not nn.Sequential.forward or all(_has_forward(c) for c in module.children())


def _called_children(prefix: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The children of `module` as a run of siblings sees them: a child without a forward (a ModuleList of blocks
    inside a ModuleList, as Funnel-Transformer's encoder holds them) is replaced by its own children, recursively."""
    found: list[tuple[str, nn.Module]] = []
    for name, child in module.named_children():
        if _has_forward(child):
            found.append((f"{prefix}{name}", child))
        else:
            found += _called_children(f"{prefix}{name}.", child)
    return found


def _subtree_bytes(module: nn.Module, claimed: set[nn.Parameter]) -> int:
    return sum(local(p).numel() * p.element_size() for p in module.parameters() if p not in claimed)


def _choose_unit_roots(model: nn.Module, wrap: object, group_mb: float) -> list[tuple[str, list[nn.Module]]]:
    """Groups of modules, each group one unit, in registration order (post-order: children before parents)."""
    units: list[tuple[str, list[nn.Module]]] = []
    claimed: set[nn.Parameter] = set()

    def claim(name: str, modules: list[nn.Module]) -> None:
        units.append((name, modules))
        for m in modules:
            claimed.update(m.parameters())

    if wrap is None:
        return units
    if isinstance(wrap, type) or (isinstance(wrap, tuple) and all(isinstance(c, type) for c in wrap)):
        for cls in wrap if isinstance(wrap, tuple) else (wrap,):
            if issubclass(cls, nn.Module) and cls.forward is nn.Module.forward:
                raise ValueError(
                    f"wrap={cls.__name__}: a {cls.__name__} has no forward of its own, so nothing calls it and a unit "
                    f"it brackets would never be gathered; name the class of the blocks it holds (e.g. the "
                    f"transformer block), or use wrap='auto'")
        for name, module in model.named_modules():
            if module is not model and isinstance(module, wrap) and not (set(module.parameters()) <= claimed):
                claim(name, [module])
        return units
    if isinstance(wrap, str) and wrap.startswith("size:"):
        threshold = float(wrap.split(":", 1)[1]) * MB

        def visit_size(prefix: str, module: nn.Module) -> None:
            for child_name, child in module.named_children():
                visit_size(f"{prefix}{child_name}.", child)
            if module is model or _subtree_bytes(module, claimed) < threshold:
                return
            if _has_forward(module):
                claim(prefix.rstrip("."), [module])
                return
            run = [(n, c) for n, c in _called_children(prefix, module) if _subtree_bytes(c, claimed) > 0]
            if run:  # a container of small blocks: they become one unit, its own parameters stay with its caller
                claim(f"{run[0][0]}..{run[-1][0]}", [c for _, c in run])

        visit_size("", model)
        return units
    if wrap != "auto":
        raise ValueError(f"wrap={wrap!r} is not a wrap policy; allowed 'auto', 'size:<MB>', a module class, or None")

    limit = group_mb * MB

    def visit_auto(prefix: str, module: nn.Module) -> None:
        # Containers of repeated blocks: group consecutive children into runs of about `limit` bytes.
        children = list(module.named_children())
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and children:
            run: list[nn.Module] = []
            run_names: list[str] = []
            size = 0
            for child_name, child in _called_children("", module):
                child_size = _subtree_bytes(child, claimed)
                if child_size >= limit:
                    if run:
                        claim(f"{prefix}{run_names[0]}..{run_names[-1]}", run)
                        run, run_names, size = [], [], 0
                    visit_auto(f"{prefix}{child_name}.", child)  # a big block may itself hold big parts
                    if _subtree_bytes(child, claimed) > 0:
                        claim(f"{prefix}{child_name}", [child])
                    continue
                if child_size == 0:
                    continue
                run.append(child)
                run_names.append(child_name)
                size += child_size
                if size >= limit:
                    claim(f"{prefix}{run_names[0]}..{run_names[-1]}", run)
                    run, run_names, size = [], [], 0
            if run:
                claim(f"{prefix}{run_names[0]}..{run_names[-1]}", run)
            return
        for child_name, child in children:
            visit_auto(f"{prefix}{child_name}.", child)

    visit_auto("", model)
    return units


def _owned_dtypes(module: nn.Module, exclude: frozenset[nn.Parameter]) -> set[torch.dtype]:
    """The dtypes of the parameters `module`'s forward reads as its own: its direct ones and those of the containers
    without a forward below it (an FNO layer's ParameterList of complex weights); a container itself owns none."""
    if not _has_forward(module):
        return set()

    def owned(m: nn.Module) -> list[nn.Parameter]:
        return [*m.parameters(recurse=False), *(p for c in m.children() if not _has_forward(c) for p in owned(c))]

    return {p.dtype for p in owned(module) if p not in exclude}


def _split_by_dtype(model: nn.Module, roots: list[tuple[str, list[nn.Module]]],
                    exclude: frozenset[nn.Parameter]) -> list[tuple[str, list[nn.Module]]]:
    """A unit is one flat buffer of one dtype. Where a unit's modules hold parameters of several dtypes (complex
    spectral weights of a Fourier neural operator beside real linear layers, a float64 head), every module inside it
    whose own parameters are of another dtype than the unit's (that of its bracketing modules' own parameters, else
    of most of its bytes) becomes a unit of its own, placed before the unit that held it, until no unit mixes; in a
    run of siblings grouped into one unit (wrap="auto"), the siblings of another dtype leave the run. A module
    holding several dtypes itself is left as it is: the unit then raises, naming the dtypes."""
    names = {m: name for name, m in model.named_modules()}
    order = {m: i for i, m in enumerate(_post_order(model))}
    roots = list(roots)
    while True:
        domain: dict[int, list[nn.Module]] = {}
        for sub, index in _module_units(model, roots).items():
            domain.setdefault(index, []).append(sub)
        for index, modules in domain.items():
            brackets = roots[index][1] if index < len(roots) else [model]
            held = {m: _owned_dtypes(m, exclude) for m in modules}
            dtypes = set().union(*held.values())
            if len(dtypes) < 2:
                continue
            own = set().union(*(held[m] for m in brackets if m in held))
            nbytes = {dt: sum(p.numel() * p.element_size() for m in modules for p in m.parameters(recurse=False)
                              if p.dtype == dt and p not in exclude) for dt in dtypes}
            main = next(iter(own)) if len(own) == 1 else max(dtypes, key=lambda dt: nbytes[dt])
            # A module of another dtype inside the unit leaves it; so does one of several siblings run together.
            split = [m for m in modules if (m not in brackets or len(brackets) > 1)
                     and len(held[m]) == 1 and held[m] != {main}]
            if split:
                if index < len(roots):
                    name, run = roots[index]
                    rest = [b for b in run if b not in split]
                    roots[index:index + 1] = [(name, rest)] if rest else []
                roots[index:index] = [(names[m], [m]) for m in sorted(split, key=order.__getitem__)]
                break
        else:
            return roots


def _module_units(model: nn.Module, roots: list[tuple[str, list[nn.Module]]]) -> dict[nn.Module, int]:
    """Each module of `model` and the index in `roots` of the unit whose modules contain it (the first, for a
    module inside two), or len(roots) for the root unit; in unit order, then module order."""
    unit: dict[nn.Module, int] = {}
    for index, (_, modules) in enumerate(roots):
        for top in modules:
            for sub in top.modules():
                unit.setdefault(sub, index)
    for sub in model.modules():
        unit.setdefault(sub, len(roots))
    return unit


def _post_order(module: nn.Module) -> list[nn.Module]:
    return [m for child in module.children() for m in _post_order(child)] + [module]


#: `group_mb=None` (the default): units of about 1/TARGET_UNITS of the model, clamped to [MIN_GROUP_MB, MAX_GROUP_MB].
TARGET_UNITS = 8
MIN_GROUP_MB = 2.0
MAX_GROUP_MB = 25.0


def auto_group_mb(model: nn.Module, exclude: frozenset[nn.Parameter] = frozenset()) -> float:
    """The unit size `wrap="auto"` aims at when none is given: about 1/8 of the model's parameter bytes, at least
    2 MiB, at most 25 MiB.

    A collective costs a fixed latency plus its bytes over the bandwidth (alpha + n beta); below about alpha / beta
    bytes it is latency-bound, and that ratio is ~1-2 MB both for gloo on loopback (~1 ms, ~1-2 GB/s) and for NCCL
    (~20 us, ~100 GB/s): smaller units cost more in calls than they win in overlap. Measured with bench/grouping.py
    (1,000 Linear(16, 16), ZeRO-3, 2 gloo ranks, alternating): units of 25 / 2 / 0.5 / 0.1 MB took 113.7 / 115.2 /
    121.7 / 135.8 ms per step, one unit per layer 1,816 ms. Above that floor, ~8 units let each gather and
    reduce-scatter overlap another unit's compute; above 25 MiB one unit's gather would dominate the step. Whole
    repeating blocks at least this big still get a unit each.
    """
    total = sum(local(p).numel() * p.element_size() for p in model.parameters() if p not in exclude)
    return min(MAX_GROUP_MB, max(MIN_GROUP_MB, total / TARGET_UNITS / MB))


def plan_units(model: nn.Module, wrap: object = "auto", group_mb: float | None = None,
               exclude: frozenset[nn.Parameter] = frozenset()) -> list[UnitPlan]:
    """Group `model`'s parameters into units (see the module docstring); the root unit, always present, comes last.
    Parameters in `exclude` belong to no unit (the engine keeps them whole and replicated). `group_mb=None`: the
    size `auto_group_mb` picks from the model."""
    if group_mb is None:
        group_mb = auto_group_mb(model, exclude)
    if not group_mb > 0:
        raise ValueError(f"group_mb={group_mb!r} must be a positive number of MiB")
    roots = _split_by_dtype(model, _choose_unit_roots(model, wrap, group_mb), exclude)
    owner: dict[nn.Parameter, int] = {}
    locations: dict[nn.Parameter, list[tuple[nn.Module, str]]] = {}
    module_unit = _module_units(model, roots)
    root_index = len(roots)
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if p in exclude:
                continue
            locations.setdefault(p, []).append((module, name))
            unit = module_unit[module]
            if p in owner and owner[p] != unit:
                owner[p] = root_index  # tied across units: gathered once, by the root
            else:
                owner.setdefault(p, unit)
    plans = [UnitPlan(name, modules, [], {}) for name, modules in roots]
    plans.append(UnitPlan("<root>", [model], [], {}, is_root=True))
    for p, index in owner.items():  # dict order = first registration order
        plans[index].params.append(p)
        plans[index].locations[p] = locations[p]
    return [u for u in plans if u.params or u.is_root]

