"""ParallelLayout math, checked against Megatron's own RankGenerator (no process groups needed)."""

from __future__ import annotations

import pytest

from hybridrl.distributed import LayoutError, ParallelLayout

LAYOUTS = [
    dict(world_size=1),
    dict(world_size=8, tp=2, pp=2),
    dict(world_size=8, tp=8),
    dict(world_size=16, tp=2, pp=2, cp=2),
    dict(world_size=12, tp=3, pp=2),
    dict(world_size=128, tp=8, pp=4),  # 70B-class: 4 nodes x 8 GPUs x 4 replicas
    dict(world_size=64, tp=4, pp=2, cp=2, vpp=3),
]


@pytest.mark.parametrize("kw", LAYOUTS, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_groups_match_megatron(kw):
    from hybridrl.mcore.parallel_state import megatron_rank_groups

    layout = ParallelLayout.from_world(**kw)
    for axis in ("tp", "pp", "dp", "cp", "mp"):
        assert layout.groups(axis) == megatron_rank_groups(layout, axis), axis


@pytest.mark.parametrize("kw", LAYOUTS, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_coords_roundtrip_and_partition(kw):
    layout = ParallelLayout.from_world(**kw)
    assert layout.tp * layout.pp * layout.dp * layout.cp == layout.world_size
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        assert layout.rank_of(**c._asdict()) == rank
    for axis in ("tp", "pp", "dp", "cp"):
        groups = layout.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(layout.world_size))
        assert all(len(g) == getattr(layout, axis) for g in groups)


def test_tp_peers_are_adjacent():
    layout = ParallelLayout.from_world(16, tp=4, pp=2)
    assert layout.group_of("tp", 5) == [4, 5, 6, 7]
    assert layout.group_of("pp", 5) == [5, 13]
    assert layout.dp == 2
    assert layout.describe() == "tp=4 pp=2 dp=2 (world 16)"


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(world_size=8, tp=2, pp=2, dp=3), "tp(2) * pp(2) * dp(3) != world_size(8)"),
        (dict(world_size=8, tp=3), "world_size(8) is not divisible by tp(3) * pp(1) * cp(1) = 3"),
        (dict(world_size=8, tp=2, vpp=2), "vpp (2) > 1 needs pp > 1"),
        (dict(world_size=8, tp=2, ep=3), "ep (3) must divide dp * cp (4)"),
        (dict(world_size=8, tp=0), "tp (0) must be a positive integer"),
    ],
)
def test_errors_state_the_numbers(kw, message):
    with pytest.raises(LayoutError) as err:
        ParallelLayout.from_world(**kw)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_rank_outside_world():
    with pytest.raises(LayoutError, match=r"rank \(8\) is outside world_size \(8\)"):
        ParallelLayout.from_world(8, tp=2).coords(8)
