"""CheckReport: what `sw.check` found, as data (`ok`, `first_mismatch`, `rows`) and as text (`str(report)`).

The text, top down: a header (strategy, ranks, steps, OK or DIFFERS; optimizer, clipping, tolerances); the first
mismatch in run order; notes (diagnoses that are cheap and certain, most telling first); the loss and gradient norm
of every step on both sides; then one row per tensor in model order (parameters, then buffers) with the largest
absolute and relative difference over the run and where it was. Models with many tensors show the rows that differ
and count the rest (`report.text(verbose=True)` shows every row).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

__all__ = ["CheckReport", "Mismatch", "TensorRow", "PHASES"]

#: The phases compared at every step, in run order.
PHASES = ("forward", "gradient", "clip", "update")
_SHOW_ALL_UP_TO = 40  # tensors: at most this many rows are shown without verbose


class Mismatch(NamedTuple):
    """The first difference in run order. index: the element (a tuple; () for a scalar, None when the whole tensor
    differs: None against a tensor, another shape, or ranks that disagree). got / want: the element's value under the
    strategy and in one process (None for a gradient that is None, or that is None on some ranks only; for a tensor
    compared with None, its largest |value|)."""

    step: int
    phase: str
    name: str
    index: tuple[int, ...] | None
    got: float | None
    want: float | None

    def describe(self) -> str:
        """"step 1, gradient: blocks.0.mlp.fc.weight[3, 7] = 0.1234 vs 0.1233 in one process"."""
        where = f"step {self.step}, {self.phase}: {self.name}"
        if self.index is not None:
            if self.index:
                where += f"[{', '.join(map(str, self.index))}]"
            return f"{where} = {_num(self.got, 7)} vs {_num(self.want, 7)} in one process"
        if self.got is None and self.want is None:  # only ranks that disagree give this
            return f"{where} is None on some ranks and a tensor on others (None in one process)"
        got = "None" if self.got is None else f"a tensor (max |value| {_num(self.got)})"
        want = "None" if self.want is None else f"a tensor (max |value| {_num(self.want)})"
        if self.got is not None and self.want is not None:
            got, want = "a tensor of another shape", "the tensor"
        return f"{where} is {got} vs {want} in one process"


@dataclasses.dataclass
class TensorRow:
    """One tensor over the whole run. kind: "parameter" or "buffer". max_abs / max_rel: the largest |got - want| and
    |got - want| / |want| over every step and phase; worst: (step, phase) of max_abs. ok: within rtol / atol
    everywhere. note: what no number says ("grad None vs tensor at step 1", "missing under the strategy")."""

    name: str
    kind: str
    shape: tuple[int, ...]
    max_abs: float = 0.0
    max_rel: float = 0.0
    worst: tuple[int, str] | None = None
    ok: bool = True
    note: str = ""


@dataclasses.dataclass
class CheckReport:
    """The result of `sw.check`. ok: every compared value within rtol / atol. first_mismatch: None, or the first
    difference in run order (a Mismatch: step, phase, name, index, got, want). rows: one TensorRow per parameter
    (canonical original name) and buffer, in model order. losses / norms: per step (ranks, one process); norms is
    empty without clipping. notes: diagnoses. `bool(report)` is `report.ok`; `str(report)` is `report.text()`."""

    strategy: str
    world_size: int
    dp: int
    steps: int
    optimizer: str
    max_norm: float | None
    rtol: float
    atol: float
    backend: str
    first_mismatch: Mismatch | None
    rows: list[TensorRow]
    losses: list[tuple[float, float]]
    norms: list[tuple[float, float]]
    notes: list[str] = dataclasses.field(default_factory=list)
    accumulate: int = 1  # batches per optimizer step

    @property
    def ok(self) -> bool:
        return self.first_mismatch is None

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        return self.text()

    def text(self, verbose: bool = False) -> str:
        """The report as text; verbose=True lists every tensor even in large models."""
        clip = f"clip max_norm {self.max_norm:g}" if self.max_norm is not None else "no clipping"
        lines = [f"shardwise check: {self.strategy} on {self.world_size} {self.backend} rank"
                 f"{'s' if self.world_size != 1 else ''} (data parallel {self.dp}), {self.steps} step"
                 f"{'s' if self.steps != 1 else ''}"
                 f"{f' of {self.accumulate} accumulated batches' if self.accumulate > 1 else ''}: "
                 f"{'OK' if self.ok else 'DIFFERS'}",
                 f"  vs one process on the global batch: {self.optimizer}, {clip}, rtol {self.rtol:g}, "
                 f"atol {self.atol:g}"]
        if self.first_mismatch is not None:
            lines.append(f"first mismatch: {self.first_mismatch.describe()}")
        lines += [f"note: {n}" for n in self.notes]
        lines.append("")
        lines += self._steps_table()
        lines.append("")
        lines += self._tensor_table(verbose)
        return "\n".join(lines)

    def _steps_table(self) -> list[str]:
        head = f"{'step':>4}  {'loss':>12} {'one process':>12} {'|diff|':>8}"
        if self.norms:
            head += f"  {'grad norm':>12} {'one process':>12} {'|diff|':>8}"
        out = [head]
        for step, (got, want) in enumerate(self.losses):
            line = f"{step:>4}  {got:>12.6g} {want:>12.6g} {_num(abs(got - want)):>8}"
            if step < len(self.norms):
                g, w = self.norms[step]
                line += f"  {g:>12.6g} {w:>12.6g} {_num(abs(g - w)):>8}"
            out.append(line)
        return out

    def _tensor_table(self, verbose: bool) -> list[str]:
        shown = self.rows if verbose or len(self.rows) <= _SHOW_ALL_UP_TO else [r for r in self.rows if not r.ok]
        labels = [r.name + (" (buffer)" if r.kind == "buffer" else "") for r in shown]
        width = max([len("tensor"), *map(len, labels)])
        out = [f"{'tensor':<{width}}  {'shape':<14} {'max |diff|':>10} {'max rel':>10}  worst"]
        for r, label in zip(shown, labels):
            shape = "x".join(map(str, r.shape)) or "scalar"
            worst = f"step {r.worst[0]} {r.worst[1]}" if r.worst is not None and r.max_abs > 0 else "-"
            flag = "" if r.ok else "  DIFFERS"
            note = f"  ({r.note})" if r.note else ""
            out.append(f"{label:<{width}}  {shape:<14} {_num(r.max_abs):>10} {_num(r.max_rel):>10}  "
                       f"{worst}{flag}{note}".rstrip())
        hidden = len(self.rows) - len(shown)
        if hidden:
            out.append(f"... and {hidden} more tensors within rtol {self.rtol:g} / atol {self.atol:g} "
                       f"(report.text(verbose=True) lists them)")
        return out


def _num(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "None"
    if value == 0:
        return "0"
    return f"{value:.{digits}g}"
