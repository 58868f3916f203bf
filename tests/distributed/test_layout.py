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
        (dict(world_size=6, tp=2, rollout_tp=4), "rollout_tp (4) must divide world_size (6)"),
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


# ---- the generation layout ---------------------------------------------------------------------------------------
def _vllm_engines(world: int, tp: int) -> list[list[int]]:
    """vLLM's own TP groups under ``external_launcher``, as its ``initialize_model_parallel`` forms them: the world's
    ranks laid out row by row in rows of ``tp`` (``arange(world).view(-1, tp)``), each row one engine."""
    rows, row = [], []
    for rank in range(world):
        row.append(rank)
        if len(row) == tp:
            rows.append(row)
            row = []
    return rows


@pytest.mark.parametrize(
    ("world", "tp", "pp", "rollout_tp"),
    [(128, 8, 4, 4), (128, 8, 4, 16), (128, 8, 4, 1), (8, 2, 2, 4), (12, 3, 2, 6), (1, 1, 1, 1)],
)
def test_rollout_groups_match_an_independent_enumeration(world, tp, pp, rollout_tp):
    layout = ParallelLayout.from_world(world, tp=tp, pp=pp, rollout_tp=rollout_tp)
    engines = _vllm_engines(world, rollout_tp)
    assert layout.rollout_replicas == len(engines) == world // rollout_tp
    assert layout.groups("rollout_tp") == engines
    # a replica group: the k-th rank of every engine (the data-parallel split of generation), in engine order
    assert layout.groups("rollout_dp") == [[engine[k] for engine in engines] for k in range(rollout_tp)]
    for replica, engine in enumerate(engines):
        for k, rank in enumerate(engine):
            assert layout.rollout_coords(rank) == (k, replica)
            assert layout.rollout_rank_of(tp=k, replica=replica) == rank
            assert layout.group_of("rollout_tp", rank) == engine


def test_rollout_at_128_ranks_tp8_pp4_dp4():
    """70B-class: 16 nodes x 8 GPUs; training TP 8 x PP 4 x DP 4, generation TP 4: 32 engines, two per node,
    each inside one training TP group (the switch's TP all_gather and vLLM's TP stay on one node's links)."""
    layout = ParallelLayout.from_world(128, tp=8, pp=4, rollout_tp=4)
    assert (layout.dp, layout.rollout_replicas) == (4, 32)
    assert layout.describe_rollout() == "rollout tp=4 x 32 replicas"
    train_tp = layout.groups("tp")
    for engine in layout.groups("rollout_tp"):
        assert len({rank // 8 for rank in engine}) == 1  # one node
        assert any(set(engine) <= set(group) for group in train_tp)
    replicas = layout.groups("rollout_dp")
    assert [len(g) for g in replicas] == [32] * 4 and sorted(r for g in replicas for r in g) == list(range(128))
    assert layout.rollout_coords(37) == (1, 9) and layout.coords(37) == (5, 0, 0, 1)  # dp 0 of stage 1


def test_with_rollout_tp_keeps_training_and_validates():
    layout = ParallelLayout.from_world(8, tp=2, pp=2, rollout_tp=4)
    hf = layout.with_rollout_tp(1)
    assert (hf.tp, hf.pp, hf.dp, hf.rollout_tp, hf.rollout_replicas) == (2, 2, 2, 1, 8)
    assert hf.groups("rollout_dp") == [list(range(8))]
    with pytest.raises(LayoutError, match=r"rollout_tp \(3\) must divide world_size \(8\)") as err:
        layout.with_rollout_tp(3)
    assert err.value.axis == "rollout_tp"
    with pytest.raises(LayoutError, match=r"rollout_tp \(0\) must be a positive integer"):
        ParallelLayout.from_world(8, rollout_tp=0)
