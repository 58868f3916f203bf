"""Inference engines behind one interface (:class:`RolloutEngine`); vLLM is imported only when an engine
is built, so importing this package stays cheap."""

from hybridrl.rollout.base import RolloutEngine, pack_rollout, unpad_prompts
from hybridrl.rollout.vllm_engine import VLLMRolloutEngine

__all__ = ["RolloutEngine", "VLLMRolloutEngine", "pack_rollout", "unpad_prompts"]
