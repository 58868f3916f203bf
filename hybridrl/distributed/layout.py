"""Parallel layout math: how a world of ranks splits into tensor, context, data and pipeline groups.

Pure Python, no process groups: the same code validates a 1,024-rank config on a laptop and builds the
real groups at run time. Rank order follows Megatron-Core's default ``tp-cp-ep-dp-pp``: tensor-parallel
peers are adjacent ranks (they share a node and its fast links), pipeline stages are the slowest axis.

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

Expert parallelism (``ep``) does not change the dense layout: it splits the data-parallel ranks of the
expert layers, so ``ep`` must divide ``dp * cp``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

from hybridrl.errors import InputError

AXES = ("tp", "cp", "dp", "pp")  # fastest to slowest


class LayoutError(InputError, ValueError):
    """A parallel layout that cannot be built; the message names the numbers and the fix."""


class RankCoords(NamedTuple):
    """Position of one rank on each parallel axis."""

    tp: int
    cp: int
    dp: int
    pp: int


@dataclass(frozen=True)
class ParallelLayout:
    """A validated split of ``world_size`` ranks into TP x CP x DP x PP (plus VPP and EP).

    Build it with :meth:`from_world`, which derives ``dp`` and checks every constraint.
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    vpp: int = 1

    @classmethod
    def from_world(
        cls,
        world_size: int,
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
        ep: int = 1,
        vpp: int = 1,
        dp: int | None = None,
    ) -> ParallelLayout:
        """Derive ``dp = world_size / (tp * pp * cp)`` (or check a given ``dp``) and validate."""
        for name, value in (("world_size", world_size), ("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep), ("vpp", vpp)):
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name} ({value!r}) must be a positive integer")
        model_parallel = tp * pp * cp
        if dp is None:
            if world_size % model_parallel:
                raise LayoutError(
                    f"world_size({world_size}) is not divisible by tp({tp}) * pp({pp}) * cp({cp}) = {model_parallel}; "
                    f"choose sizes whose product divides the number of ranks"
                )
            dp = world_size // model_parallel
        layout = cls(world_size=world_size, tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, vpp=vpp)
        layout.validate()
        return layout

    def validate(self) -> None:
        """Raise :class:`LayoutError` naming the numbers if the layout is inconsistent."""
        if self.dp < 1:
            raise LayoutError(f"dp ({self.dp}) must be a positive integer")
        product = self.tp * self.pp * self.cp * self.dp
        if product != self.world_size:
            cp = f" * cp({self.cp})" if self.cp > 1 else ""
            raise LayoutError(
                f"tp({self.tp}) * pp({self.pp}) * dp({self.dp}){cp} != world_size({self.world_size}); "
                f"set dp to world_size / (tp * pp * cp) or change the world size"
            )
        if self.vpp > 1 and self.pp == 1:
            raise LayoutError(f"vpp ({self.vpp}) > 1 needs pp > 1 (got pp={self.pp}); set vpp=1 or raise pp")
        if (self.dp * self.cp) % self.ep:
            raise LayoutError(f"ep ({self.ep}) must divide dp * cp ({self.dp * self.cp}); lower ep or raise dp")

    # ---- rank math -------------------------------------------------------------------------------------
    def _sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}

    def coords(self, rank: int) -> RankCoords:
        """Coordinates of ``rank`` on each axis."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank ({rank}) is outside world_size ({self.world_size})")
        out = []
        for axis in AXES:
            size = self._sizes()[axis]
            out.append(rank % size)
            rank //= size
        return RankCoords(*out)

    def rank_of(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """Global rank at the given coordinates (inverse of :meth:`coords`)."""
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def groups(self, axis: str) -> list[list[int]]:
        """All groups along ``axis`` ("tp", "cp", "dp", "pp", or "mp" = tp x pp), each as sorted global ranks."""
        sizes = self._sizes()
        if axis == "mp":
            varying = ("tp", "pp")
        elif axis in sizes:
            varying = (axis,)
        else:
            raise LayoutError(f"unknown axis {axis!r}; valid: {', '.join(AXES)}, mp")
        fixed = [a for a in AXES if a not in varying]
        result = []
        for fixed_vals in itertools.product(*(range(sizes[a]) for a in fixed)):
            base = dict(zip(fixed, fixed_vals, strict=True))
            group = []
            for var_vals in itertools.product(*(range(sizes[a]) for a in varying)):
                group.append(self.rank_of(**base, **dict(zip(varying, var_vals, strict=True))))
            result.append(sorted(group))
        return sorted(result)

    def group_of(self, axis: str, rank: int) -> list[int]:
        """The ``axis`` group that contains ``rank``."""
        for group in self.groups(axis):
            if rank in group:
                return group
        raise LayoutError(f"rank ({rank}) is outside world_size ({self.world_size})")

    def describe(self) -> str:
        """One line such as ``tp=2 pp=2 dp=2 (world 8)``."""
        extra = "".join(f" {k}={v}" for k, v in (("cp", self.cp), ("ep", self.ep), ("vpp", self.vpp)) if v > 1)
        return f"tp={self.tp} pp={self.pp} dp={self.dp}{extra} (world {self.world_size})"
