"""The parallel styles a tensor-parallel plan maps module names to, and the checks every built-in plan shares.

=================================  =====================================================================================
``"colwise"`` / :class:`Colwise`    nn.Linear -> ColumnParallelLinear (split by output features; ``fused=k`` splits k
                                     side-by-side output blocks separately, ``fused=(sizes)`` uneven ones;
                                     ``gather_output=True`` returns full outputs)
``"rowwise"`` / :class:`Rowwise`    nn.Linear -> RowParallelLinear (split by input features; output all-reduced, or
                                     reduce-scattered along the sequence under sequence parallel)
``"vocab"`` / :class:`Vocab`        nn.Embedding -> VocabParallelEmbedding (split by vocabulary rows)
``"sequence"`` / :class:`Sequence`  a module with replicated parameters (LayerNorm, RMSNorm, a position embedding) that
                                     runs on sequence shards under sequence parallel: its parameters' gradients are
                                     all-reduced over the group. Without sequence parallel it is left as it is.
``"heads"`` / :class:`Heads`        a module with replicated parameters that runs on this rank's attention heads (a
                                     per-head norm: Qwen3's q_norm / k_norm) or MLP features (an activation's scalars:
                                     Apertus's xIELU): each rank's gradient is its part, so the gradients are
                                     all-reduced over the group, with or without sequence parallel
``"head_rows"`` / :class:`HeadRows`  a module whose own parameters have one row per attention head (GPT-OSS's
                                     sinks): each rank keeps its heads' rows (head_rows.py)
``"split_norm"`` / :class:`SplitNorm`  an RMSNorm over the whole output width of a colwise projection (OLMo 2's
                                     q_norm / k_norm): its weight split like the projection's output, its mean square
                                     summed over the group (split_norm.py)
=================================  =====================================================================================
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Union

from torch import nn

__all__ = ["Colwise", "Rowwise", "Vocab", "Sequence", "Heads", "HeadRows", "SplitNorm", "Style", "STYLES", "as_style",
           "check_divides", "has_own_forward", "pattern_matches"]


@dataclasses.dataclass(frozen=True)
class Colwise:
    """Column-parallel Linear.

    gather_output: all-gather the output features (full output on every rank), e.g. a head whose logits go to a
        loss that needs the whole vocabulary. fused: number of equal output blocks side by side (3 for [q|k|v]), or
    their sizes (Phi-3's uneven [q|k|v] under grouped-query attention); each block is split on its own.
    """

    gather_output: bool = False
    fused: int | tuple[int, ...] = 1


@dataclasses.dataclass(frozen=True)
class Rowwise:
    """Row-parallel Linear. input_is_parallel: the input holds this rank's features (a colwise layer's output)."""

    input_is_parallel: bool = True


@dataclasses.dataclass(frozen=True)
class Vocab:
    """Vocabulary-parallel Embedding (rows split across ranks)."""


@dataclasses.dataclass(frozen=True)
class Sequence:
    """Replicated parameters used on sequence shards: gradients all-reduced under sequence parallel."""


@dataclasses.dataclass(frozen=True)
class Heads:
    """Replicated parameters used on this rank's attention heads (a per-head norm) or MLP features (an activation's
    scalars): gradients always all-reduced (torchtitan plans Qwen3's q_norm / k_norm as SequenceParallel over the heads
    dimension, to the same effect)."""


@dataclasses.dataclass(frozen=True)
class HeadRows:
    """The module's own parameters with one row per attention head (GPT-OSS's attention sinks): each rank keeps the
    rows of its heads (head_rows.py); their gradients are complete on the rank."""


@dataclasses.dataclass(frozen=True)
class SplitNorm:
    """An RMSNorm over the whole output width of a column-parallel projection (OLMo 2's q_norm / k_norm): each rank
    keeps its features' weights and the mean square is summed over the group (split_norm.py)."""


Style = Union[Colwise, Rowwise, Vocab, Sequence, Heads, HeadRows, SplitNorm]
STYLES = {"colwise": Colwise(), "rowwise": Rowwise(), "vocab": Vocab(), "sequence": Sequence(), "heads": Heads(),
          "head_rows": HeadRows(), "split_norm": SplitNorm()}


def as_style(pattern: str, style: object) -> Style:
    if isinstance(style, (Colwise, Rowwise, Vocab, Sequence, Heads, HeadRows, SplitNorm)):
        return style
    if isinstance(style, str) and style in STYLES:
        return STYLES[style]
    raise ValueError(f"parallelize: plan[{pattern!r}]={style!r} is not a style; allowed {sorted(STYLES)} or a "
                     f"Colwise / Rowwise / Vocab / Sequence / Heads / HeadRows / SplitNorm object (plan='hf' reads "
                     f"a HuggingFace model's own plan, in HuggingFace's style names)")


def pattern_matches(name: str, pattern: str) -> bool:
    """Whether a plan pattern (fnmatch, `*` crossing dots) matches a dotted module name whole or as a suffix."""
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)


def check_divides(what: str, value: int, tp: int, hint: str = "") -> None:
    if value % tp:
        raise ValueError(f"parallelize: tp size {tp} does not divide {what}={value}{hint}")


def has_own_forward(module: nn.Module, base: type[nn.Module]) -> bool:
    """Whether `module`, an instance of `base` (nn.Linear, nn.Embedding), overrides its forward: a parallel layer
    replacing it would compute `base`'s forward instead (transformers' GemmaTextScaledWordEmbedding scales its
    output)."""
    return type(module).forward is not base.forward
