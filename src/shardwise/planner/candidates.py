"""Strategy strings and the candidates that apply to a world: what `sw.distribute` and `shardwise plan` compare.

A strategy string names a layout (Lightning's strategy strings are the model: "ddp", "fsdp", "deepspeed_stage_3"):

    "ddp"                                   data parallel, bucketed all-reduce (sw.DDP)
    "zero1" | "zero2" | "zero3"             ZeRO stages over every rank (sw.ZeRO); "deepspeed_stage_N" is an alias
    "fsdp" = "fsdp:full_shard"              ZeRO-3 with PyTorch FSDP's name (sw.FSDP)
    "fsdp:shard_grad_op" | "fsdp:no_shard"
    "fsdp:hybrid_shard"                     full_shard within groups of `shard_size` ranks (default: one node)
    "tp"                                    tensor parallel over every rank (every rank feeds the same batch)
    "3d:dp=2,tp=2,pp=2[,dp_strategy=zero1]" data x tensor x pipeline through sw.parallelize (dp_strategy default ddp)
    "5d:dp=2,cp=2,ep=2,tp=1,pp=1[,dp_strategy=ddp]"
                                            the same with context parallel (cp ranks split each sequence) and expert
                                            parallel (ep ranks, borrowed from dp x cp, split the experts; any
                                            dp_strategy but fsdp:hybrid_shard); the world is dp x cp x tp x pp;
                                            keys left out are 1 (dp: the remaining ranks)

A `Candidate` is one such layout resolved for a world size, plus a CPU offload level for the sharded engine.
`candidates()` lists those an automatic choice compares: the data-parallel family, tensor parallel within a node,
pipeline meshes, and CPU offload.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Candidate", "STRATEGY_STRINGS", "DP_FAMILY", "parse_strategy", "candidates", "divisors"]

#: The fixed strategy strings (plus "3d:dp=..,tp=..,pp=..", "5d:dp=..,cp=..,ep=..,tp=..,pp=.." and "auto").
STRATEGY_STRINGS = ("ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp:full_shard", "fsdp:shard_grad_op",
                    "fsdp:no_shard", "fsdp:hybrid_shard", "tp", "deepspeed_stage_1", "deepspeed_stage_2",
                    "deepspeed_stage_3")
#: Data-parallel strategies sw.parallelize accepts over its dp axis (hybrid.DP_STRATEGIES).
DP_FAMILY = ("ddp", "zero1", "zero2", "zero3", "fsdp:full_shard", "fsdp:shard_grad_op", "fsdp:hybrid_shard")
_ALIASES = {"fsdp": "fsdp:full_shard", "deepspeed_stage_1": "zero1", "deepspeed_stage_2": "zero2",
            "deepspeed_stage_3": "zero3"}
# dp strategy -> key of costs.SHARDED
_STATES = {"ddp": "ddp", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3", "fsdp:full_shard": "full_shard",
           "fsdp:shard_grad_op": "shard_grad_op", "fsdp:no_shard": "no_shard", "fsdp:hybrid_shard": "hybrid_shard"}
_ALLOWED = (f"{STRATEGY_STRINGS}, '3d:dp=A,tp=B,pp=C[,dp_strategy=S]', '5d:dp=A,cp=B,ep=C,tp=D,pp=E[,dp_strategy=S]' "
            f"or 'auto'")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One layout for a world: dp x cp x tp x pp ranks, the data-parallel strategy over dp (x cp), and a CPU offload
    level.

    kind: "dp" (a data-parallel strategy over every rank), "tp" (tensor parallel over every rank) or "3d"
    (sw.parallelize over a mesh; with cp or ep > 1 its string is "5d:..."). shard: the shard-group size of
    fsdp:hybrid_shard. offload: None, "optimizer" or "full" (the sharded engine's cpu_offload). cp: context-parallel
    ranks; ep: expert-parallel ranks, borrowed from dp x cp.
    """

    kind: str
    dp_strategy: str
    dp: int
    tp: int = 1
    pp: int = 1
    shard: int | None = None
    offload: str | None = None
    cp: int = 1
    ep: int = 1

    @property
    def strategy(self) -> str:
        """The strategy string that builds this layout (without the offload level)."""
        if self.kind == "dp":
            return self.dp_strategy
        if self.kind == "tp":
            return "tp"
        if self.cp > 1 or self.ep > 1:
            text = f"5d:dp={self.dp},cp={self.cp},ep={self.ep},tp={self.tp},pp={self.pp}"
        else:
            text = f"3d:dp={self.dp},tp={self.tp},pp={self.pp}"
        return text if self.dp_strategy == "ddp" else f"{text},dp_strategy={self.dp_strategy}"

    @property
    def label(self) -> str:
        """The strategy string, with the shard size of hybrid_shard and the offload level when there are some."""
        text = self.strategy
        if self.shard is not None:
            text += f" (shard {self.shard})"
        if self.offload:
            text += f" + offload={self.offload}"
        return text

    @property
    def states_key(self) -> str:
        """The key of costs.SHARDED that gives this layout's model-state formula."""
        return _STATES[self.dp_strategy]

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp

    @property
    def data_parallel(self) -> int:
        """The ranks dense gradients average over: dp x cp (each cp rank's loss covers a share of every sequence)."""
        return self.dp * self.cp


def _positive(name: str, text: str, strategy: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"strategy={strategy!r}: {name}={text!r} must be a positive int")
    return value


def _parse_mesh(text: str, world_size: int) -> Candidate:
    """A "3d:dp=..,tp=..,pp=.." or "5d:dp=..,cp=..,ep=..,tp=..,pp=.." string (each with an optional dp_strategy)."""
    five = text.startswith("5d:")
    keys = ("dp", "cp", "ep", "tp", "pp") if five else ("dp", "tp", "pp")
    example = "'5d:dp=2,cp=2,ep=2'" if five else "'3d:dp=2,tp=2,pp=2'"
    sizes: dict[str, int] = {}
    dp_strategy = "ddp"
    for part in text.split(":", 1)[1].split(","):
        key, sep, value = part.strip().partition("=")
        if not sep:
            raise ValueError(f"strategy={text!r}: {part!r} is not key=value; write e.g. {example}")
        if key in keys:
            sizes[key] = _positive(key, value, text)
        elif key == "dp_strategy":
            if value not in DP_FAMILY:
                raise ValueError(f"strategy={text!r}: dp_strategy={value!r} is not allowed; allowed {DP_FAMILY}")
            dp_strategy = value
        elif key in ("cp", "ep"):
            raise ValueError(f"strategy={text!r}: {key} is a key of the 5-D strings; write e.g. "
                             f"'5d:dp=2,{key}=2,tp=1,pp=1'")
        else:
            raise ValueError(f"strategy={text!r}: unknown key {key!r}; allowed {', '.join(keys)}, dp_strategy")
    cp, ep, tp, pp = (sizes.get(k, 1) for k in ("cp", "ep", "tp", "pp"))
    product = " x ".join(k for k in ("dp", "cp", "tp", "pp") if k in keys)
    if world_size % (cp * tp * pp):
        rest = "cp x tp x pp" if five else "tp x pp"
        numbers = " x ".join(str(v) for v in ((cp, tp, pp) if five else (tp, pp)))
        raise ValueError(f"strategy={text!r}: {rest} = {numbers} = {cp * tp * pp} does not divide the world size "
                         f"{world_size}")
    dp = sizes.get("dp", world_size // (cp * tp * pp))
    if dp * cp * tp * pp != world_size:
        numbers = " x ".join(str(v) for v in ((dp, cp, tp, pp) if five else (dp, tp, pp)))
        raise ValueError(f"strategy={text!r}: {product} = {numbers} = {dp * cp * tp * pp}, but the world has "
                         f"{world_size} ranks; the product must equal the world size")
    # What sw.parallelize refuses at wrap time (hybrid_plan.check_plan), refused here by the same rules.
    if (dp * cp) % ep:
        raise ValueError(f"strategy={text!r}: ep={ep} must divide dp x cp = {dp} x {cp} = {dp * cp} (expert parallel "
                         f"borrows its ranks from the data- and context-parallel ones)")
    if ep > 1 and dp_strategy == "fsdp:hybrid_shard":
        allowed = tuple(s for s in DP_FAMILY if s != "fsdp:hybrid_shard")
        raise ValueError(f"strategy={text!r}: ep={ep} with dp_strategy='fsdp:hybrid_shard' is not supported (its "
                         f"shard groups cut across the ranks holding the same experts, edp); allowed {allowed}")
    return Candidate("3d", dp_strategy, dp, tp, pp, cp=cp, ep=ep)


def parse_strategy(text: object, world_size: int, *, shard_size: int | None = None,
                   devices_per_node: int | None = None, offload: str | None = None) -> Candidate:
    """The Candidate a strategy string names on `world_size` ranks. Raises ValueError naming `strategy` and what is
    allowed, or the sizes that do not divide."""
    if not isinstance(text, str):
        raise ValueError(f"strategy={text!r} must be a string; allowed {_ALLOWED}")
    name = _ALIASES.get(text, text)
    if name.startswith(("3d:", "5d:")):
        return dataclasses.replace(_parse_mesh(name, world_size), offload=offload)
    if name not in _STATES and name != "tp":
        raise ValueError(f"strategy={text!r} is not known; allowed {_ALLOWED}")
    if name == "tp":
        return Candidate("tp", "ddp", 1, tp=world_size)
    shard = None
    if name == "fsdp:hybrid_shard":
        shard = shard_size
        if shard is None and devices_per_node and 1 < devices_per_node < world_size \
                and world_size % devices_per_node == 0:
            shard = devices_per_node
        if isinstance(shard, bool) or not isinstance(shard, int) or shard < 1 or world_size % shard:
            raise ValueError(f"strategy='fsdp:hybrid_shard' needs shard_size, a positive int dividing the world size "
                             f"{world_size} (default: the ranks per node when that divides it); got "
                             f"shard_size={shard!r}")
    elif shard_size is not None:
        raise ValueError(f"shard_size={shard_size!r} only applies to strategy='fsdp:hybrid_shard'")
    return Candidate("dp", name, world_size, shard=shard, offload=offload)


def candidates(world_size: int, devices_per_node: int, *, tensor_parallel: bool = True, pipeline: bool = True,
               offload: bool = True, max_pp: int | None = None, tp_divides: tuple[int, ...] = ()) -> list[Candidate]:
    """The layouts an automatic choice compares on `world_size` ranks with `devices_per_node` per node.

    tensor_parallel / pipeline / offload: whether the model (a tensor-parallel plan, pipeline layers) and the device
    (offload is pointless when the device is the CPU) allow them. Tensor parallel stays within a node (its
    per-layer all-reduces need the fast links); max_pp bounds the pipeline stages (the model's layers);
    tp_divides: sizes tp must divide (heads, vocabulary), when known. Pipelines have at most 8 stages (and max_pp),
    with tp 1 or the largest tp that fits the rest, to keep the table short.
    """
    n, node = world_size, max(1, min(devices_per_node, world_size))
    out = [Candidate("dp", s, n) for s in ("ddp", "zero1", "zero2", "fsdp:shard_grad_op", "zero3")]
    if 1 < node < n and n % node == 0:
        out.append(Candidate("dp", "fsdp:hybrid_shard", n, shard=node))
    tps = [t for t in divisors(n) if 1 < t <= node and all(d % t == 0 for d in tp_divides)] if tensor_parallel else []
    if n in tps:
        out.append(Candidate("tp", "ddp", 1, tp=n))
    out += [Candidate("3d", "zero1", n // t, t, 1) for t in tps if t < n]
    if pipeline:  # up to 8 stages (longer pipelines only add bubble), with tp 1 or the largest that divides
        for p in divisors(n)[1:]:
            if p > min(8, max_pp or 8):
                continue
            within = [t for t in tps if (n // p) % t == 0]
            for t in [1] + within[-1:]:
                dp = n // (p * t)
                out.append(Candidate("3d", "zero1" if dp > 1 else "ddp", dp, t, p))
    if offload:
        out += [Candidate("dp", "zero2", n, offload="optimizer"), Candidate("dp", "zero3", n, offload="optimizer"),
                Candidate("dp", "zero3", n, offload="full")]
    return out
