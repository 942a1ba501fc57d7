"""Compare the strategy's run with one process's: phase by phase, step by step, into a CheckReport.

Values are compared in float64 as `torch.isclose` does: an element differs when |got - want| > atol + rtol x |want|
(NaN equals NaN: both runs diverged alike). A gradient that is None on one side and a tensor on the other differs
whatever the tensor holds: one process leaves a parameter that took no part in the loss with grad None, and torch
optimizers then skip it (no weight decay, no moment update), while a zero gradient is stepped.

The first mismatch is the first difference in run order (step, then forward, gradient, clip, update; tensors in
model order, buffers after parameters); its element is the one with the largest |got - want| among those out of
tolerance. The table keeps going over the whole run.
"""

from __future__ import annotations

from typing import Any

import torch

from .forward_outputs import first_difference
from .report import CheckReport, Mismatch, TensorRow
from .run import Trace

__all__ = ["compare"]

_MISSING = object()


def _max_abs(t: torch.Tensor | None) -> float | None:
    return None if t is None else (float(t.detach().double().abs().max()) if t.numel() else 0.0)


class _Comparer:
    def __init__(self, rtol: float, atol: float) -> None:
        self.rtol, self.atol = rtol, atol
        self.first: Mismatch | None = None

    def visit(self, row: TensorRow, step: int, phase: str, got: Any, want: torch.Tensor | None) -> bool:
        """Compare one tensor at one step and phase; update its row and the first mismatch; True when it differs."""
        if got is _MISSING:
            return self.whole(row, step, phase, None, want, "missing under the strategy")
        if got is None or want is None:
            if got is None and want is None:
                return False
            side = lambda t: "None" if t is None else "a tensor"  # noqa: E731
            return self.whole(row, step, phase, got, want,
                               f"{phase} {side(got)} vs {side(want)} in one process at step {step}")
        if tuple(got.shape) != tuple(want.shape):
            return self.whole(row, step, phase, got, want, f"shape {tuple(got.shape)} vs {tuple(want.shape)}")
        if not got.numel():
            return False
        g, w = got.detach().double().cpu(), want.detach().double().cpu()
        diff = (g - w).abs()
        both_nan = g.isnan() & w.isnan()
        diff = torch.where(both_nan, torch.zeros_like(diff), torch.nan_to_num(diff, nan=float("inf")))
        bad = diff > self.atol + self.rtol * w.abs()
        # Relative to elements that are not rounding noise themselves (|want| > atol): 1e-9 vs 2e-9 is no news.
        rel = torch.where(w.abs() > self.atol, diff / w.abs(), torch.zeros_like(diff))
        max_abs, max_rel = float(diff.max()), float(rel.max())
        if row.worst is None or max_abs > row.max_abs:
            row.max_abs, row.worst = max_abs, (step, phase)
        row.max_rel = max(row.max_rel, max_rel)
        if not bool(bad.any()):
            return False
        row.ok = False
        if self.first is None:
            flat = int(torch.where(bad, diff, torch.full_like(diff, -1.0)).reshape(-1).argmax())
            index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(g.shape))) if g.dim() else ()
            self.first = Mismatch(step, phase, row.name, index, float(g.reshape(-1)[flat]), float(w.reshape(-1)[flat]))
        return True

    def whole(self, row: TensorRow, step: int, phase: str, got: Any, want: Any, note: str) -> bool:
        """A difference of the whole tensor (None against a tensor, a shape, ranks that disagree): no element."""
        row.ok = False
        row.note = row.note or note
        if self.first is None:
            self.first = Mismatch(step, phase, row.name, None, _max_abs(got), _max_abs(want))
        return True


def _scalar(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float64)


def compare(ref: Trace, got: Trace, *, strategy: str, world_size: int, max_norm: float | None, rtol: float,
            atol: float, backend: str, accumulate: int = 1) -> CheckReport:
    """The report of `got` (the strategy's run) against `ref` (one process)."""
    to_got = {}  # reference canonical name -> the strategy's canonical name (a tie may list its names otherwise)
    for name, aliases in got.aliases.items():
        for alias in aliases:
            to_got.setdefault(alias, name)
    first_step = ref.steps[0]
    rows = {n: TensorRow(n, "parameter", tuple(first_step.params[n].shape)) for n in ref.aliases}
    buffer_rows = {n: TensorRow(n, "buffer", tuple(b.shape)) for n, b in first_step.buffers.items()}
    loss_row, norm_row = TensorRow("loss", "scalar", ()), TensorRow("grad norm", "scalar", ())
    c = _Comparer(rtol, atol)
    split_notes: list[str] = []
    for step, (r, g) in enumerate(zip(ref.steps, got.steps)):
        c.visit(loss_row, step, "forward", _scalar(g.loss), _scalar(r.loss))
        for name, row in rows.items():
            if to_got.get(name) in g.split_grads:  # the ranks disagree: a difference whatever the numbers say
                c.whole(row, step, "gradient", None, r.grads[name], f"gradient None on some ranks and a tensor on "
                        f"others at step {step}")
                split_notes.append(f"the gradient of {name} is None on some ranks and a tensor on others at step "
                                   f"{step}: the ranks of a strategy must agree whether a parameter has one")
                continue
            c.visit(row, step, "gradient", g.grads.get(to_got.get(name, ""), _MISSING), r.grads[name])
        if r.norm is not None and g.norm is not None:
            c.visit(norm_row, step, "clip", _scalar(g.norm), _scalar(r.norm))
        for name, row in rows.items():
            c.visit(row, step, "update", g.params.get(to_got.get(name, ""), _MISSING), r.params[name])
        for name, row in buffer_rows.items():
            c.visit(row, step, "update", g.buffers.get(name, _MISSING), r.buffers[name])
    report = CheckReport(strategy, world_size, got.dp, len(ref.steps), ref.optimizer, max_norm, rtol, atol, backend,
                         c.first, [*rows.values(), *buffer_rows.values()],
                         [(g.loss, r.loss) for r, g in zip(ref.steps, got.steps)],
                         [(g.norm, r.norm) for r, g in zip(ref.steps, got.steps) if r.norm is not None
                          and g.norm is not None], accumulate=accumulate)
    report.notes = _diagnose(report, ref, got) + list(dict.fromkeys(split_notes))
    return report


def _diagnose(report: CheckReport, ref: Trace, got: Trace) -> list[str]:
    """Notes that are cheap and certain, the most telling first."""
    m = report.first_mismatch
    if m is None:
        return []
    notes = []
    if m.phase == "forward" and m.step == 0:
        notes.append("the loss differs at step 0, before any gradient or update: the ranks do not compute what one "
                     "process computes on the whole batch. The check compares the average of the data-parallel "
                     "ranks' losses with the global batch's, which holds when the loss is a mean over examples of "
                     "equal weight (not a sum, not a mean over unevenly padded tokens) and nothing random runs")
        where = first_difference(ref.outputs, got.outputs, ref.kinds, got.kinds, got.dp_index, got.dp, report.rtol,
                                 report.atol)
        if where is not None:
            notes.append(where)
    dropout = tuple(dict.fromkeys((*ref.dropout, *got.dropout)))
    if dropout:
        notes.append(f"Dropout with p > 0 in training mode ({_names(dropout)}): its random masks differ between "
                     f"one process and the ranks; build the model with dropout 0 for the check")
    drew = tuple(n for n in ref.drew if n not in dropout)  # one process watches (forward_outputs.py)
    if drew:
        named = ", ".join(f"{n!r} ({ref.kinds[n]})" if n in ref.kinds else repr(n) for n in drew[:4])
        more = f", ... {len(drew) - 4} more" if len(drew) > 4 else ""
        notes.append(f"the forward draws random numbers outside nn.Dropout modules, in {named}{more} (functional "
                     f"dropout such as F.dropout(x, p, self.training), noise, stochastic depth): one process and "
                     f"the ranks draw other numbers there; set those probabilities to 0 (the model's config) for "
                     f"the check")
    if got.dp > 1 and got.batchnorm:
        notes.append(f"BatchNorm in training mode ({_names(got.batchnorm)}) under data parallel {got.dp}: each rank "
                     f"normalizes by its own slice's statistics (batch_norm='local', torch DDP's semantics), one "
                     f"process by the whole batch's; wrap with batch_norm='sync' (or sw.SyncBatchNorm.convert(model, "
                     f"comm), in a callable strategy) for whole-batch statistics")
    if m.phase == "gradient" and m.index is None and m.want is None and m.got is not None:
        zeros = " of zeros" if m.got == 0 else ""
        notes.append(f"{m.name} took no part in the loss at step {m.step}: one process leaves its grad None, and "
                     f"torch optimizers skip it (no weight decay, no moment update); the strategy gave it a gradient"
                     f"{zeros}, which the optimizer steps (DDP: find_unused_parameters=True keeps it None)")
    if m.phase == "clip":  # the first mismatch: every gradient of this step matched
        notes.append("every gradient matches but the norm differs: the norm counts some gradient pieces more than "
                     "once or misses some (each piece must count once: layout.counts_here)")
    if m.phase == "update" and m.index is not None and "Adam" in report.optimizer:
        grads = ref.steps[m.step].grads
        want = grads.get(m.name)
        largest = max((_max_abs(t) or 0.0 for t in grads.values()), default=0.0)
        element = abs(float(want[m.index])) if want is not None and want.dim() == len(m.index) else None
        if element is not None and largest > 0 and element < 1e-5 * largest:
            notes.append(f"the gradient of {m.name}[{', '.join(map(str, m.index))}] at step {m.step} is at "
                         f"rounding-noise level ({element:.2g}, against {largest:.2g} for the largest element) and "
                         f"Adam divides each step by sqrt(v) + eps, which steps noise by up to lr x noise / eps, so a "
                         f"different summation order (a split batch) moves it: likely the optimizer amplifying "
                         f"rounding, not the strategy. Rerun with a larger eps (optimizer=lambda p: "
                         f"torch.optim.AdamW(p, lr=1e-3, eps=1e-5)) to confirm")
    rounding = _rounding_scale(report, ref)
    if rounding is not None:
        notes.append(rounding)
    return notes


_ROUNDING = 1e-4  # the relative difference below which float32 summation order can explain every difference


def _rounding_scale(report: CheckReport, ref: Trace) -> str | None:
    """A note when every difference is small enough for a model below float64 to owe it to rounding: the ranks sum
    split batches in another order (1e-7 per float32 operation), which training compounds; in float64 a correct
    strategy agrees to ~1e-12, so a check there tells rounding from a bug (a planted 1.001 scale stays 1e-3)."""
    m = report.first_mismatch
    dtypes = {t.dtype for t in ref.steps[0].params.values()} if ref.steps else set()
    if m is None or m.index is None or not dtypes or torch.float64 in dtypes:
        return None
    largest = max(max((_against_scale(row, ref) for row in report.rows if not row.ok), default=0.0),
                  max((abs(g - w) / abs(w) for g, w in report.losses if w), default=0.0))
    if largest >= _ROUNDING:
        return None
    kinds = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
    return (f"every difference is below {_ROUNDING:g} of its tensor's largest element (largest {largest:.2g}) in a "
            f"{kinds} model: "
            f"the scale at which summing split batches in another order rounds differently and training compounds "
            f"it. Check the model in float64 (build_model=lambda: build().double(), float batches .double()), where "
            f"a correct strategy agrees to ~1e-12, to tell rounding from a bug")


def _against_scale(row: TensorRow, ref: Trace) -> float:
    """The row's largest difference over the largest element of its tensor in one process where that difference
    was (relative to single elements, a gradient element near zero differs by its whole size); inf when unknown."""
    if row.worst is None or row.note:
        return float("inf")
    step, phase = row.worst
    record = ref.steps[step]
    tensor = record.grads.get(row.name) if phase == "gradient" else \
        record.params.get(row.name, record.buffers.get(row.name))
    scale = _max_abs(tensor) if isinstance(tensor, torch.Tensor) else None
    return row.max_abs / scale if scale else float("inf")


def _names(names: tuple[str, ...], shown: int = 4) -> str:
    more = f", ... {len(names) - shown} more" if len(names) > shown else ""
    return "modules " + ", ".join(repr(n) if n else "(the model)" for n in names[:shown]) + more
