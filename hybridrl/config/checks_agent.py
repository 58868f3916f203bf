"""Config check of ``rollout.agent`` (multi-turn rollouts): its limits are usable numbers.

The environment itself (its file, class, tools and the chat template) is checked by
:func:`hybridrl.rollout.agent.registry.load_agent` at start-up, before any model is built (the config layer does
not import the rollout package). One of :data:`hybridrl.config.checks.CHECKS`, in its own module as each
feature's checks are.
"""

from __future__ import annotations

from hybridrl.config.schema import ConfigError, RunConfig


def agent_enabled(cfg: RunConfig) -> bool:
    """The run generates multi-turn trajectories (``rollout.agent.env`` or ``rollout.agent.path`` is set)."""
    a = cfg.rollout.agent
    return a.env is not None or a.path is not None


def check_agent(cfg: RunConfig, world: int) -> None:
    """``rollout.agent``'s limits: at least one turn, positive timeouts and sizes, a turn limit within the budget."""
    a = cfg.rollout.agent
    for key, value in (("max_turns", a.max_turns), ("max_tool_output_chars", a.max_tool_output_chars),
                       ("max_workers", a.max_workers)):  # fmt: skip
        if value < 1:
            fix = "; set it to 1 for single-turn trajectories" if key == "max_turns" else ""
            raise ConfigError(f"rollout.agent.{key} ({value}) must be >= 1{fix}", key=f"rollout.agent.{key}")
    if a.tool_timeout_s <= 0:
        raise ConfigError(f"rollout.agent.tool_timeout_s ({a.tool_timeout_s}) must be positive (seconds)",
                          key="rollout.agent.tool_timeout_s")  # fmt: skip
    budget = cfg.rollout.response_length
    if a.max_tokens_per_turn is not None and not 1 <= a.max_tokens_per_turn <= budget:
        raise ConfigError(
            f"rollout.agent.max_tokens_per_turn ({a.max_tokens_per_turn}) must be in [1, data.max_response_length "
            f"({budget})]: the response length is the whole trajectory's budget; set it to null (the budget left)",
            key="rollout.agent.max_tokens_per_turn",
        )
