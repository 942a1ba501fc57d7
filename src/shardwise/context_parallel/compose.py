"""How context parallel composes with tensor parallel applied before it (torchtitan's order: tp, then cp, ...).

Attention is independent per head. Tensor parallel (Megatron's plans "gpt" and "llama") gives each rank of a
tensor-parallel group n_heads / tp whole heads: its column-parallel q, k, v projections produce only those heads,
and the attention module derives its local head count from their width. Context parallel then runs ring attention
or Ulysses on exactly those local heads, among the cp ranks that share this rank's tensor-parallel coordinate
(``mesh.cp``), so the two splits never meet inside attention:

* ring attention (ring.py) passes the key/value blocks of the local heads around the cp ring: any head count;
* Ulysses (ulysses.py) re-splits the local heads over the cp ranks: n_heads / tp must be divisible by cp, which
  :func:`check_method` refuses otherwise, naming the three numbers.

Sequence parallel (Korthikanti et al. 2022) splits the sequence over tp *inside* this rank's cp chunk: the residual
stream holds rows [t L/tp, (t+1) L/tp) of the L tokens of the chunk, the column-parallel q, k, v projections
all-gather those rows over ``mesh.tp`` before attention (so attention sees the whole chunk, in split order) and the
row-parallel output projection reduce-scatters them again. The tensor-parallel GPT asks the position embedding for
rows [t L/tp, (t+1) L/tp) of the chunk (tensor_parallel/gpt.py); context parallel, told by the tensor-parallel record
that the sequence is split over tp, reads them as rows of a chunk of L = tp x (rows asked) tokens and returns their
global positions (apply.py), so every row keeps its place in the whole sequence.

What the model already has is read from its declared layout (shardwise.layout): a tensor-parallel record beneath is
allowed, any other strategy (data parallel, sharding, pipeline) must come after context parallel.
"""

from __future__ import annotations

from torch import nn

from .. import layout

__all__ = ["METHODS", "attention_dropout", "attention_heads", "check_method", "tensor_parallel_beneath"]

METHODS = ("ring", "ulysses")
#: strategies context parallel may be applied on top of (by their layout record's name)
BENEATH = ("tensor_parallel",)


def attention_heads(model: nn.Module) -> tuple[str, int] | None:
    """(config field, global head count) of the shardwise GPT or a HuggingFace decoder; None if unknown."""
    config = getattr(model, "config", None)
    for field in ("n_heads", "num_attention_heads"):
        value = getattr(config, field, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return field, value
    return None


def attention_dropout(model: nn.Module) -> tuple[str, float] | None:
    """(config field, value) of a nonzero attention dropout, which ring / Ulysses attention does not implement: the
    GPT's ``dropout`` (it drops attention probabilities too), HF's ``attention_dropout`` or GPT-2's ``attn_pdrop``."""
    config = getattr(model, "config", None)
    for field in ("dropout", "attention_dropout", "attn_pdrop"):
        value = getattr(config, field, 0.0)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value:
            return field, value
    return None


def tensor_parallel_beneath(model: nn.Module, who: str) -> tuple[int, bool]:
    """(tp size, sequence parallel) that tensor parallel declared on `model` ((1, False) if none); ValueError if
    another strategy was applied."""
    records = layout.strategies(model)
    others = [r.name for r in records if r.name not in BENEATH]
    if others:
        applied = " + ".join(r.name for r in records)
        raise ValueError(f"{who}: the model is already wrapped ({applied}); apply context parallel to the plain (or "
                         f"tensor-parallel) model first, then data parallel (DDP / ZeRO / FSDP)")
    if not records:
        return 1, False
    options = records[0].options  # what tensor parallel was asked for: {"plan", "sequence_parallel", "tp"}
    return int(options.get("tp", 1)), bool(options.get("sequence_parallel", False))


def check_method(model: nn.Module, cp: int, method: object, *, tp: int = 1, who: str = "context_parallel.apply",
                 arg: str = "method") -> None:
    """ValueError unless `method` is allowed and, for Ulysses, the heads each tensor-parallel rank holds
    (heads / tp) split evenly over `cp` ranks. Called before anything is changed (sw.parallelize's plan check)."""
    if method not in METHODS:
        raise ValueError(f"{who}: {arg}={method!r}; allowed {METHODS}")
    heads = attention_heads(model)
    if method != "ulysses" or heads is None:
        return
    field, count = heads
    local = count // tp
    if tp > 1 and local % cp:
        raise ValueError(f"{who}: {arg}='ulysses' needs the heads of each tensor-parallel rank, {field}={count} / "
                         f"tp={tp} = {local}, divisible by cp={cp}; allowed cp: divisors of {local} (or "
                         f"{arg}='ring', which takes any head count)")
    if count % cp:
        raise ValueError(f"{who}: {arg}='ulysses' needs {field}={count} divisible by cp={cp}; allowed cp: divisors "
                         f"of {count} (or {arg}='ring')")
