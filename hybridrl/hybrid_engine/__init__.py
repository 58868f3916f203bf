"""The 3D-HybridEngine: reshard the actor's Megatron weights into vLLM's per-rank layout between phases.

- ``vllm_layout``: vLLM's per-rank tensors (fused ``qkv_proj`` / ``gate_up_proj``, padded vocab) per family
- ``planner``: which Megatron shard rows land where (pure math, checked on 70B-scale layouts), buckets
- ``need_plan``: what each rank sends to / receives from its model-parallel peers (pure math): only the rows
  its rollout shard needs and does not hold
- ``buckets``: the transports per flat bucket, double-buffered: one all-to-all of the needed blocks (none at
  equal TP), or the older PP broadcast + TP all_gather
- ``engine``: :class:`HybridEngine`, the reshard itself: one ``hybridrl.ops.block_copy`` per bucket into a
  preallocated destination buffer; views of training tensors where the layouts agree
- ``probe``: :class:`SwitchProbe`, the switch's self-check after each push (sampled elements vs the actor's)
- ``switch``: :class:`RolloutSwitch`, the phase switch the actor worker calls: the push into the rollout engine
  (skipped when it holds the actor's version), its sleep / wake-up by tag, and parking around generation
"""

from hybridrl.hybrid_engine.engine import HybridEngine, SwitchStats
from hybridrl.hybrid_engine.planner import ReshardPlan
from hybridrl.hybrid_engine.probe import ProbeError, SwitchProbe
from hybridrl.hybrid_engine.switch import RolloutSwitch
from hybridrl.hybrid_engine.vllm_layout import PlanError

__all__ = ["HybridEngine", "PlanError", "ProbeError", "ReshardPlan", "RolloutSwitch", "SwitchProbe", "SwitchStats"]
