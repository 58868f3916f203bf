"""Multi-turn, tool-using rollouts: environments and tools (:mod:`~hybridrl.rollout.agent.interface`), their
loading and checks (:mod:`~hybridrl.rollout.agent.registry`), tool-call parsers, chat rendering, and the agent loop
(:mod:`~hybridrl.rollout.agent.loop`) that generates trajectories token-in-token-out on the vLLM engine.

What a user writes lives in the interface module; ``docs/agents.md`` walks through it. Importing this package
does not import vLLM.
"""

from hybridrl.rollout.agent.interface import (
    AgentError,
    Environment,
    Step,
    Tool,
    ToolCall,
    ToolResult,
    Turn,
    tool,
    tool_messages,
)
from hybridrl.rollout.agent.parsers import register_parser
from hybridrl.rollout.agent.registry import known_environments, load_agent, register_environment

__all__ = [
    "AgentError",
    "Environment",
    "Step",
    "Tool",
    "ToolCall",
    "ToolResult",
    "Turn",
    "known_environments",
    "load_agent",
    "register_environment",
    "register_parser",
    "tool",
    "tool_messages",
]
