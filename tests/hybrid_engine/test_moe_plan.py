"""The MoE reshard plan as pure math (no process groups): vLLM's stacked expert tensors per rollout rank.

Shapes and sources of each expert part, written here from vLLM's FusedMoE rules (TP-sharded experts: rank j holds
rows j of every expert; ``enable_expert_parallel``: rank j holds experts ``[j E / tp, (j + 1) E / tp)`` whole),
the bytes each rank must receive at EP2 (the other rank's experts, exactly), and the one-line refusals.
"""

from __future__ import annotations

import pytest

from hybridrl.distributed.layout import ParallelLayout
from hybridrl.hybrid_engine import PlanError, need_plan
from hybridrl.hybrid_engine.planner import ReshardPlan
from hybridrl.hybrid_engine.vllm_layout import split_part
from hybridrl.mcore.hf_config import shape_from_hf
from tests.mcore import hf_tiny_moe

E, F, H, LAYERS = hf_tiny_moe.EXPERTS, 64, 128, 2


def _shape(**overrides):
    return shape_from_hf(hf_tiny_moe.tiny_config("qwen3_moe", **overrides))


def _parts(plan: ReshardPlan, j: int, which: str) -> list:
    return [d for d in plan.dests[j] if split_part(d.name) and split_part(d.name)[0].endswith(which)]


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_rollout_tp2_expert_parts_follow_vllm(expert_parallel):
    layout = ParallelLayout.from_world(2, ep=2, rollout_tp=2)
    plan = ReshardPlan(_shape(), layout, family="qwen3_moe", pad_vocab=True, transport="need",
                       expert_parallel=expert_parallel)  # fmt: skip
    for j in range(2):
        w13, w2 = _parts(plan, j, "w13_weight"), _parts(plan, j, "w2_weight")
        local = E // 2 if expert_parallel else E
        f = F if expert_parallel else F // 2
        assert len(w13) == len(w2) == LAYERS * local
        assert {d.shape for d in w13} == {(2 * f, H)} and {d.shape for d in w2} == {(H, f)}
        for d in w13[:local]:  # layer 0
            e = split_part(d.name)[1]
            want = j * local + e if expert_parallel else e
            assert {s.src for s in d.segments} == {
                f"decoder.layers.0.mlp.experts.local_experts.{want}.linear_fc1.weight"
            }
            rows = sorted((s.src_pos, s.size) for s in d.segments)  # [gate_j; up_j] of Megatron's [gate; up]
            assert rows == ([(0, F), (F, F)] if expert_parallel else [(j * f, f), (F + j * f, f)]), rows
        assert all(d.shared is None for d in w13 + w2)  # a stacked tensor is one storage


def test_ep2_to_tp1_each_rank_needs_exactly_the_other_ranks_experts():
    layout = ParallelLayout.from_world(2, ep=2, rollout_tp=1)
    plan = ReshardPlan(_shape(), layout, family="qwen3_moe", transport="need", element_size=4)
    other = LAYERS * (E // 2) * (2 * F * H + H * F)
    for rank in range(2):
        npl = need_plan.for_rank(plan, rank)
        assert npl.needed_numel == other == sum(sum(s) for s in npl.recv_splits)
        assert sum(sum(s) for s in npl.send_splits) == other


def test_bad_rollout_sizes_are_one_line_errors():
    with pytest.raises(PlanError, match=r"rollout.tp_size \(8\) must not exceed the number of experts \(4\)"):
        wide = _shape(num_attention_heads=8, num_key_value_heads=8, head_dim=16)  # only the experts stop TP 8
        ReshardPlan(wide, ParallelLayout.from_world(8, rollout_tp=8), family="qwen3_moe")
    with pytest.raises(PlanError, match=r"rollout.sync_transport \(gather\) .* use rollout.sync_transport=need"):
        ReshardPlan(_shape(), ParallelLayout.from_world(2, ep=2), family="qwen3_moe", transport="gather")
