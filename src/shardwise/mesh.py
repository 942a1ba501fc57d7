"""Mesh: the validated layout of the world over five axes, built once and passed to every strategy.

Axes. The world is dp x cp x tp x pp: data parallel (dp: replicas, each on its own part of the global batch),
context parallel (cp: the ranks of a replica split each sequence), tensor parallel (tp: the ranks split each layer)
and pipeline parallel (pp: each rank holds some layers). Expert parallel (ep) is not a fifth factor of the world: it
**borrows its ranks from dp x cp** (ep must divide dp x cp), as in Megatron-core and torchtitan. Dense weights are
data-parallel over the dp x cp ranks of a (tp, pp) position; the experts of a MoE layer are split over ep of those
ranks, and each expert is data-parallel over the rest (the expert-data-parallel group, edp = dp x cp / ep).

Order. Ranks are laid out with tp varying fastest, then cp, then dp, then pp (Megatron-LM's and torchtitan's order):
world rank `r = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index`. Tensor-parallel peers are
neighbours (on a GPU cluster, one node, where bandwidth is highest); context-parallel peers, which pass K/V blocks
around a ring every layer, come next; pipeline stages, which exchange only activations, are farthest apart. Within
the dp x cp ranks of one (tp, pp) position, numbered `f = dp_index * cp + cp_index`, the ep group of a rank is the
block of ep consecutive f (its expert index is `f % ep`) and its edp group the ranks with the same `f % ep`.

Each axis gets a sub-Communicator: `mesh.tp` joins the ranks that differ only in tp_index, and so on; `mesh.dp_cp`
joins dp x cp (what dense gradients average over when cp > 1), `mesh.ep` and `mesh.edp` as above. Building a Mesh
is collective: every rank of `comm` builds the same one (each `split` is).
"""

from __future__ import annotations

import dataclasses

from .comm.base import Communicator

__all__ = ["Mesh", "Coordinates"]

AXES = ("dp", "cp", "tp", "pp")  # the factors of the world, slowest-varying last


@dataclasses.dataclass(frozen=True)
class Coordinates:
    """This rank's position on each axis of the mesh (ep: its index within its expert-parallel group)."""

    dp: int
    tp: int
    pp: int
    cp: int = 0
    ep: int = 0


def _check_axis(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Mesh: {name}={value!r} must be a positive int")
    return value


class Mesh:
    """A dp x cp x tp x pp grid over the ranks of `comm`, with ep borrowed from dp x cp (see the module docstring).

    `Mesh(comm, dp=None, *, cp=1, ep=1, tp=1, pp=1)`: dp=None takes every rank left over (world // (cp x tp x pp)).
    Raises ValueError, showing the numbers, when the product differs from the world size or ep does not divide
    dp x cp. Attributes: `dp`, `cp`, `ep`, `edp`, `dp_cp`, `tp`, `pp` (sub-Communicators; a size-1 axis still has
    one), `sizes` (dict of every axis, edp included), `coords` (Coordinates), `world` (the comm). The axes after dp
    are keyword-only: `Mesh(comm, 2, 2)` would not say which axis the second 2 is.
    """

    def __init__(self, comm: Communicator, dp: int | None = None, *, cp: int = 1, ep: int = 1, tp: int = 1,
                 pp: int = 1) -> None:
        self._layout(comm.size, dp, cp, ep, tp, pp, comm.rank)
        self.world = comm
        s, c = self.sizes, self.coords
        dp, cp, tp, ep = s["dp"], s["cp"], s["tp"], s["ep"]
        flat = c.dp * cp + c.cp  # this rank's index among the dp x cp ranks of its (tp, pp) position
        # Each split's color names the group: the coordinates on the *other* axes.
        self.tp: Communicator = comm.split((c.pp * dp + c.dp) * cp + c.cp, key=c.tp)  # type: ignore[assignment]
        self.cp: Communicator = comm.split((c.pp * dp + c.dp) * tp + c.tp, key=c.cp)  # type: ignore[assignment]
        self.dp: Communicator = comm.split((c.pp * cp + c.cp) * tp + c.tp, key=c.dp)  # type: ignore[assignment]
        self.pp: Communicator = comm.split((c.dp * cp + c.cp) * tp + c.tp, key=c.pp)  # type: ignore[assignment]
        self.dp_cp: Communicator = comm.split(c.pp * tp + c.tp, key=flat)  # type: ignore[assignment]
        self.ep: Communicator = comm.split((c.pp * tp + c.tp) * (dp * cp // ep) + flat // ep,  # type: ignore
                                           key=flat % ep)
        self.edp: Communicator = comm.split((c.pp * tp + c.tp) * ep + flat % ep, key=flat // ep)  # type: ignore

    @classmethod
    def dry_run(cls, world_size: int, dp: int | None = None, *, cp: int = 1, ep: int = 1, tp: int = 1,
                pp: int = 1) -> Mesh:
        """A Mesh of `world_size` ranks for planning and describe(), without processes: validated the same way,
        seen from rank 0, with no communicators (every axis attribute and `mesh.world` are None)."""
        mesh = cls.__new__(cls)
        mesh._layout(_check_axis("world_size", world_size), dp, cp, ep, tp, pp, 0)
        mesh.world = mesh.dp = mesh.cp = mesh.ep = mesh.edp = mesh.dp_cp = mesh.tp = mesh.pp = None  # type: ignore
        return mesh

    def _layout(self, world: int, dp: int | None, cp: int, ep: int, tp: int, pp: int, r: int) -> None:
        cp, ep, tp, pp = (_check_axis(n, v) for n, v in (("cp", cp), ("ep", ep), ("tp", tp), ("pp", pp)))
        if dp is None:
            if world % (cp * tp * pp):
                raise ValueError(f"Mesh: cp x tp x pp = {cp} x {tp} x {pp} = {cp * tp * pp} does not divide the world "
                                 f"size {world}, so dp cannot be inferred")
            dp = world // (cp * tp * pp)
        dp = _check_axis("dp", dp)
        if dp * cp * tp * pp != world:
            raise ValueError(f"Mesh: dp x cp x tp x pp = {dp} x {cp} x {tp} x {pp} = {dp * cp * tp * pp}, but the "
                             f"world has {world} ranks; the product must equal the world size")
        if (dp * cp) % ep:
            raise ValueError(f"Mesh: ep={ep} must divide dp x cp = {dp} x {cp} = {dp * cp}: expert parallel borrows "
                             f"its ranks from the data- and context-parallel ones (allowed: a divisor of {dp * cp})")
        self.sizes = {"dp": dp, "cp": cp, "ep": ep, "edp": dp * cp // ep, "tp": tp, "pp": pp}
        self.world_size = world
        tp_i, cp_i, dp_i = r % tp, (r // tp) % cp, (r // (tp * cp)) % dp
        self.coords = Coordinates(dp=dp_i, tp=tp_i, pp=r // (tp * cp * dp), cp=cp_i, ep=(dp_i * cp + cp_i) % ep)

    @staticmethod
    def rank_of(dp_index: int, tp_index: int, pp_index: int, *, dp: int, tp: int, cp: int = 1,
                cp_index: int = 0) -> int:
        """World rank at the given coordinates (tp fastest-varying, then cp, then dp, then pp)."""
        return ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index

    def describe(self) -> str:
        """The grid as text: one block per pipeline stage, rows are dp replicas (each with its cp ranks), columns tp
        ranks; the expert-parallel groups follow when ep > 1."""
        s = self.sizes
        dp, cp, tp, pp, ep = s["dp"], s["cp"], s["tp"], s["pp"], s["ep"]
        axes = " x ".join(f"{a}={s[a]}" for a in AXES if a in ("dp", "tp", "pp") or s[a] > 1)
        extra = f", ep={ep} (borrowed from dp x cp; edp={s['edp']})" if ep > 1 else ""
        lines = [f"Mesh {axes}{extra} over {self.world_size} ranks (tp fastest); this rank: {self.coords}"]
        width = len(str(self.world_size - 1))
        for p in range(pp):
            lines.append(f"  pp stage {p}:")
            for d in range(dp):
                for k in range(cp):
                    row = " ".join(str(self.rank_of(d, t, p, dp=dp, tp=tp, cp=cp, cp_index=k)).rjust(width)
                                   for t in range(tp))
                    lines.append(f"    dp {d}{f' cp {k}' if cp > 1 else ''}: [{row}]")
        if ep > 1:
            flat = dp * cp
            groups = [[f for f in range(g * ep, (g + 1) * ep)] for g in range(flat // ep)]
            lines.append(f"  ep groups (by dp x cp index f = dp * {cp} + cp, at each tp, pp): "
                         + " ".join(str(g) for g in groups))
        return "\n".join(lines)

    def __repr__(self) -> str:
        s = self.sizes
        return (f"Mesh(dp={s['dp']}, cp={s['cp']}, ep={s['ep']}, tp={s['tp']}, pp={s['pp']}, "
                f"coords={self.coords})")
