"""Parallel layout math: how a world of ranks splits into the training groups and the generation groups.

Pure Python, no process groups: the same code validates a 1,024-rank config on a laptop and builds the
real groups at run time. One :class:`ParallelLayout` per run (built by :func:`hybridrl.config.layout.run_layout`
from the config and the launched world) is handed to everything that needs to know which ranks work together.

Training follows Megatron-Core's default order ``tp-cp-ep-dp-pp``: tensor-parallel peers are adjacent ranks
(they share a node and its fast links), pipeline stages are the slowest axis.

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

Expert parallelism (``ep``) does not change the dense layout: it splits the data-parallel ranks of the
expert layers, so ``ep`` must divide ``dp * cp``.

Generation (vLLM) lays the same ranks out again: ``rollout_tp`` consecutive ranks form one vLLM engine (a
replica, holding every layer), as vLLM's own ``external_launcher`` groups them (the world reshaped to
``(-1, rollout_tp)``), so

    rank = rollout_tp_rank + rollout_tp * replica

and the ranks with the same rollout TP rank form a replica group: the data-parallel split of generation.
This module is the only place that spells that mapping (``tests/test_house_rules.py`` checks it).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import NamedTuple

from hybridrl.errors import InputError

AXES = ("tp", "cp", "dp", "pp")  # fastest to slowest
ROLLOUT_AXES = ("rollout_tp", "rollout_dp")
"""Generation groups: the ranks of one vLLM engine, and the replica groups (one rank of every engine)."""


class LayoutError(InputError, ValueError):
    """A parallel layout that cannot be built; the message names the numbers and the fix.

    ``axis`` is the size at fault ("tp", ..., "rollout_tp"), or None, so callers can name their own key.
    """

    def __init__(self, message: str, axis: str | None = None) -> None:
        super().__init__(message)
        self.axis = axis


class RankCoords(NamedTuple):
    """Position of one rank on each training axis."""

    tp: int
    cp: int
    dp: int
    pp: int


class RolloutCoords(NamedTuple):
    """Position of one rank in the generation layout."""

    tp: int
    """Rollout TP rank: which shard of the vLLM engine this rank holds."""
    replica: int
    """Which vLLM engine (replica) this rank belongs to: its rank in its replica group."""


@dataclass(frozen=True)
class ParallelLayout:
    """A validated split of ``world_size`` ranks into TP x CP x DP x PP (plus VPP and EP) for training and into
    ``world_size / rollout_tp`` vLLM engines of ``rollout_tp`` ranks for generation.

    Build it with :meth:`from_world`, which derives ``dp`` and checks every constraint.
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    vpp: int = 1
    rollout_tp: int = 1
    """vLLM's tensor-parallel size, independent of ``tp`` (smaller, equal or larger)."""

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
        rollout_tp: int = 1,
    ) -> ParallelLayout:
        """Derive ``dp = world_size / (tp * pp * cp)`` (or check a given ``dp``) and validate."""
        sizes = (("world_size", world_size), ("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep), ("vpp", vpp),
                 ("rollout_tp", rollout_tp))  # fmt: skip
        for name, value in sizes:
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name} ({value!r}) must be a positive integer", axis=name)
        model_parallel = tp * pp * cp
        if dp is None:
            if world_size % model_parallel:
                raise LayoutError(
                    f"world_size({world_size}) is not divisible by tp({tp}) * pp({pp}) * cp({cp}) = {model_parallel}; "
                    f"choose sizes whose product divides the number of ranks",
                    axis="tp",
                )
            dp = world_size // model_parallel
        layout = cls(world_size=world_size, tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, vpp=vpp, rollout_tp=rollout_tp)
        layout.validate()
        return layout

    def validate(self) -> None:
        """Raise :class:`LayoutError` naming the numbers if the layout is inconsistent."""
        if self.dp < 1:
            raise LayoutError(f"dp ({self.dp}) must be a positive integer", axis="dp")
        product = self.tp * self.pp * self.cp * self.dp
        if product != self.world_size:
            cp = f" * cp({self.cp})" if self.cp > 1 else ""
            raise LayoutError(
                f"tp({self.tp}) * pp({self.pp}) * dp({self.dp}){cp} != world_size({self.world_size}); "
                f"set dp to world_size / (tp * pp * cp) or change the world size",
                axis="dp",
            )
        if self.vpp > 1 and self.pp == 1:
            raise LayoutError(
                f"vpp ({self.vpp}) > 1 needs pp > 1 (got pp={self.pp}); set vpp=1 or raise pp", axis="vpp"
            )
        if (self.dp * self.cp) % self.ep:
            raise LayoutError(
                f"ep ({self.ep}) must divide dp * cp ({self.dp * self.cp}); lower ep or raise dp", axis="ep"
            )
        if self.world_size % self.rollout_tp:
            raise LayoutError(
                f"rollout_tp ({self.rollout_tp}) must divide world_size ({self.world_size}): vLLM engines tile the "
                "world; choose a divisor of it",
                axis="rollout_tp",
            )

    def with_rollout_tp(self, rollout_tp: int) -> ParallelLayout:
        """The same training layout with another generation layout (validated), e.g. 1 for whole HF tensors."""
        if not isinstance(rollout_tp, int) or rollout_tp < 1:
            raise LayoutError(f"rollout_tp ({rollout_tp!r}) must be a positive integer", axis="rollout_tp")
        layout = dataclasses.replace(self, rollout_tp=rollout_tp)
        layout.validate()
        return layout

    # ---- training rank math ----------------------------------------------------------------------------
    def _sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank ({rank}) is outside world_size ({self.world_size})")

    def coords(self, rank: int) -> RankCoords:
        """Coordinates of ``rank`` on each training axis."""
        self._check_rank(rank)
        out = []
        for axis in AXES:
            size = self._sizes()[axis]
            out.append(rank % size)
            rank //= size
        return RankCoords(*out)

    def rank_of(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """Global rank at the given training coordinates (inverse of :meth:`coords`)."""
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    # ---- generation rank math --------------------------------------------------------------------------
    @property
    def rollout_replicas(self) -> int:
        """Number of vLLM engines: ``world_size / rollout_tp``."""
        return self.world_size // self.rollout_tp

    def rollout_coords(self, rank: int) -> RolloutCoords:
        """Rollout TP rank and replica of ``rank``."""
        self._check_rank(rank)
        return RolloutCoords(tp=rank % self.rollout_tp, replica=rank // self.rollout_tp)

    def rollout_rank_of(self, tp: int = 0, replica: int = 0) -> int:
        """Global rank at the given generation coordinates (inverse of :meth:`rollout_coords`)."""
        return tp + self.rollout_tp * replica

    # ---- groups ----------------------------------------------------------------------------------------
    def groups(self, axis: str) -> list[list[int]]:
        """All groups along ``axis``, each as sorted global ranks: a training axis ("tp", "cp", "dp", "pp", or
        "mp" = tp x pp), "rollout_tp" (the ranks of each vLLM engine) or "rollout_dp" (the replica groups)."""
        if axis in ROLLOUT_AXES:
            tps, replicas = range(self.rollout_tp), range(self.rollout_replicas)
            if axis == "rollout_tp":
                return [[self.rollout_rank_of(t, r) for t in tps] for r in replicas]
            return [[self.rollout_rank_of(t, r) for r in replicas] for t in tps]
        sizes = self._sizes()
        if axis == "mp":
            varying = ("tp", "pp")
        elif axis in sizes:
            varying = (axis,)
        else:
            raise LayoutError(f"unknown axis {axis!r}; valid: {', '.join((*AXES, 'mp', *ROLLOUT_AXES))}")
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
        """The training layout in one line, such as ``tp=2 pp=2 dp=2 (world 8)``."""
        extra = "".join(f" {k}={v}" for k, v in (("cp", self.cp), ("ep", self.ep), ("vpp", self.vpp)) if v > 1)
        return f"tp={self.tp} pp={self.pp} dp={self.dp}{extra} (world {self.world_size})"

    def describe_rollout(self) -> str:
        """The generation layout in one line, such as ``rollout tp=4 x 2 replicas``."""
        replicas = self.rollout_replicas
        return f"rollout tp={self.rollout_tp} x {replicas} replica{'s' * (replicas != 1)}"
