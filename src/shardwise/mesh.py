"""Mesh: the validated data x tensor x pipeline layout of the world, built once and passed to every strategy.

Ranks are laid out with tp varying fastest, then dp, then pp (Megatron-LM's order): world rank
`r = (pp_index * dp + dp_index) * tp + tp_index`. Tensor-parallel peers are therefore neighbours (on a GPU cluster,
the same node, where bandwidth is highest), and pipeline stages are the farthest apart, since they exchange only
activations. Each axis gets a sub-Communicator: `mesh.tp` joins the ranks that differ only in tp_index, and so on.
"""

from __future__ import annotations

import dataclasses

from .comm.base import Communicator

__all__ = ["Mesh", "Coordinates"]

AXES = ("dp", "tp", "pp")


@dataclasses.dataclass(frozen=True)
class Coordinates:
    """This rank's position on each axis of the mesh."""

    dp: int
    tp: int
    pp: int


def _check_axis(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Mesh: {name}={value!r} must be a positive int")
    return value


class Mesh:
    """A dp x tp x pp grid over the ranks of `comm`.

    `Mesh(comm, dp=None, tp=1, pp=1)`: dp=None takes every rank left over (world // (tp x pp)). Raises ValueError,
    showing the numbers, when the product differs from the world size. Attributes: `dp`, `tp`, `pp` (sub-
    Communicators; a size-1 axis still has one), `sizes` (dict), `coords` (Coordinates), `world` (the comm).
    Building a Mesh is collective: every rank of `comm` must build the same one.
    """

    def __init__(self, comm: Communicator, dp: int | None = None, tp: int = 1, pp: int = 1) -> None:
        self._layout(comm.size, dp, tp, pp, comm.rank)
        self.world = comm
        dp, tp = self.sizes["dp"], self.sizes["tp"]
        c = self.coords
        # Each split's color names the group: the coordinates on the *other* axes.
        self.tp: Communicator = comm.split(c.pp * dp + c.dp, key=c.tp)  # type: ignore[assignment]
        self.dp: Communicator = comm.split(c.pp * tp + c.tp, key=c.dp)  # type: ignore[assignment]
        self.pp: Communicator = comm.split(c.dp * tp + c.tp, key=c.pp)  # type: ignore[assignment]

    @classmethod
    def dry_run(cls, world_size: int, dp: int | None = None, tp: int = 1, pp: int = 1) -> Mesh:
        """A Mesh of `world_size` ranks for planning and describe(), without processes: validated the same way,
        seen from rank 0, with no communicators (`mesh.dp`, `mesh.tp`, `mesh.pp` and `mesh.world` are None)."""
        mesh = cls.__new__(cls)
        mesh._layout(_check_axis("world_size", world_size), dp, tp, pp, 0)
        mesh.world = mesh.dp = mesh.tp = mesh.pp = None  # type: ignore[assignment]
        return mesh

    def _layout(self, world: int, dp: int | None, tp: int, pp: int, r: int) -> None:
        tp = _check_axis("tp", tp)
        pp = _check_axis("pp", pp)
        if dp is None:
            if world % (tp * pp):
                raise ValueError(
                    f"Mesh: tp x pp = {tp} x {pp} = {tp * pp} does not divide the world size {world}, "
                    f"so dp cannot be inferred"
                )
            dp = world // (tp * pp)
        dp = _check_axis("dp", dp)
        if dp * tp * pp != world:
            raise ValueError(
                f"Mesh: dp x tp x pp = {dp} x {tp} x {pp} = {dp * tp * pp}, but the world has {world} ranks; "
                f"the product must equal the world size"
            )
        self.sizes = {"dp": dp, "tp": tp, "pp": pp}
        self.world_size = world
        self.coords = Coordinates(dp=(r // tp) % dp, tp=r % tp, pp=r // (tp * dp))

    @staticmethod
    def rank_of(dp_index: int, tp_index: int, pp_index: int, *, dp: int, tp: int) -> int:
        """World rank at the given coordinates (tp fastest-varying, then dp, then pp)."""
        return (pp_index * dp + dp_index) * tp + tp_index

    def describe(self) -> str:
        """The grid as text: one block per pipeline stage, rows are dp replicas, columns tp ranks."""
        dp, tp, pp = (self.sizes[a] for a in AXES)
        lines = [f"Mesh dp={dp} x tp={tp} x pp={pp} over {self.world_size} ranks (tp fastest); this rank: {self.coords}"]
        width = len(str(self.world_size - 1))
        for p in range(pp):
            lines.append(f"  pp stage {p}:")
            for d in range(dp):
                row = " ".join(str(self.rank_of(d, t, p, dp=dp, tp=tp)).rjust(width) for t in range(tp))
                lines.append(f"    dp {d}: [{row}]")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"Mesh(dp={self.sizes['dp']}, tp={self.sizes['tp']}, pp={self.sizes['pp']}, coords={self.coords})"
