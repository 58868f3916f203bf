"""Per-step metrics of multi-turn rollouts, from the per-trajectory fields the agent loop writes.

Logged by the trainer under ``agent/``: turns per trajectory, tool calls and their failures, how trajectories
ended, the share of observation tokens in the responses, the environment's reward, and the loop's timings (this
rank's: generation, waiting for environments with vLLM idle). Empty for single-turn batches.
"""

from __future__ import annotations

import numpy as np

from hybridrl.protocol import DataProto
from hybridrl.rollout.agent.episode import END_REASONS


def agent_metrics(batch: DataProto) -> dict[str, float]:
    """``agent/...`` metrics of a rollout batch (see the module docstring); {} without agent fields."""
    b = batch.batch
    if "agent_turns" not in b:
        return {}
    turns = b["agent_turns"].float()
    calls = float(b["agent_tool_calls"].sum())
    failed = float(b["agent_tool_errors"].sum() + b["agent_tool_timeouts"].sum() + b["agent_invalid_calls"].sum())
    response_tokens = float(b["attention_mask"][:, -b["responses"].shape[1] :].sum())
    out = {
        "agent/turns_mean": float(turns.mean()),
        "agent/turns_max": float(turns.max()),
        "agent/tool_calls_mean": calls / len(batch),
        "agent/tool_errors": float(b["agent_tool_errors"].sum()),
        "agent/tool_timeouts": float(b["agent_tool_timeouts"].sum()),
        "agent/invalid_calls": float(b["agent_invalid_calls"].sum()),
        "agent/tool_failure_rate": failed / calls if calls else 0.0,
        "agent/env_errors": float(b["agent_env_errors"].sum()),
        "agent/observation_token_share": float(b["agent_observation_tokens"].sum()) / max(response_tokens, 1.0),
        "agent/env_reward_mean": float(b["agent_reward"].mean()),
    }
    ends = batch.non_tensor_batch["agent_end_reasons"]
    for reason in END_REASONS:
        out[f"agent/end/{reason}"] = float(np.mean(ends == reason))
    for key, value in batch.meta_info.get("agent_timing", {}).items():
        out[f"agent/{key}"] = float(value)
    return out
