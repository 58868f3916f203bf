"""One trajectory of a multi-turn rollout: its tokens, and the environment's turn that runs between two turns.

:class:`Trajectory` holds what the agent loop appends (the tokens vLLM generated, mask 1 and their log-probs; the
observation tokens, mask 0) and the trajectory's counts. :func:`environment_turn` is the work done after a policy
turn, in a worker thread so that the loop keeps generating for other trajectories meanwhile: it builds the
environment on the first turn (``Env()`` + ``reset(extra_info)``), parses the turn's tool calls, runs them (each in
its own thread, ``rollout.agent.tool_timeout_s`` each), calls ``env.step`` (same limit) and tokenizes the
observation. Nothing the user's code does escapes it: a tool that raises, returns non-text or hangs, and a call
that cannot be made, become ``error: ...`` observations and counts; an environment that raises, hangs or answers
something that is not a :class:`~hybridrl.rollout.agent.interface.Step` ends the trajectory with reason "error".
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from hybridrl.rewards.manager import run_with_timeouts
from hybridrl.rollout.agent.interface import (
    ERROR,
    INVALID,
    OK,
    TIMEOUT,
    Step,
    Tool,
    ToolCall,
    ToolResult,
    Turn,
    check_arguments,
    environment_tools,
)

DONE, MAX_TURNS, BUDGET, END_ERROR = "done", "max_turns", "budget", "error"
END_REASONS = (DONE, MAX_TURNS, BUDGET, END_ERROR)
"""Why a trajectory ended: the environment said done; ``rollout.agent.max_turns`` turns; the token budget (the
response length) is spent; the environment failed."""


@dataclass
class Trajectory:
    """The tokens and counts of one trajectory (row ``index`` of the rollout batch)."""

    index: int
    prompt_ids: list[int]
    extra_info: dict[str, Any]
    seed: int | None
    response: list[int] = field(default_factory=list)
    """Policy and observation tokens after the prompt, in order."""
    mask: list[int] = field(default_factory=list)
    """1 on policy tokens, 0 on observation tokens."""
    log_probs: list[float] = field(default_factory=list)
    """vLLM's log-prob of each policy token; 0 on observation tokens."""
    turns: int = 0
    env: Any = None
    tools: dict[str, Tool] = field(default_factory=dict)
    reward: float = 0.0
    end: str | None = None
    finish_reason: str = "stop"
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))

    def add(self, tokens: Sequence[int], log_probs: Sequence[float] | None) -> None:
        """Append policy tokens (with their log-probs) or, with ``log_probs`` None, observation tokens."""
        self.response.extend(tokens)
        self.mask.extend([0 if log_probs is None else 1] * len(tokens))
        self.log_probs.extend([0.0] * len(tokens) if log_probs is None else log_probs)


COUNTS = ("tool_calls", "tool_errors", "tool_timeouts", "invalid_calls", "env_errors", "observation_tokens")
"""Per-trajectory counts: calls written (made or not), calls that raised or returned non-text, calls past the
timeout, calls that could not be made, environment failures, observation tokens appended."""


@dataclass
class Outcome:
    """What :func:`environment_turn` decided for one trajectory's turn."""

    observation_ids: list[int] | None
    """Tokens to append before the next turn; None when the trajectory ends."""
    reward: float = 0.0
    end: str | None = None
    """:data:`END_ERROR` when the environment failed; otherwise the loop decides (done / limits)."""
    done: bool = False
    counts: dict[str, int] = field(default_factory=dict)
    message: str = ""
    """Why the environment failed (for the log)."""


def _call_tool(t: Tool, call: ToolCall, timeout_s: float, max_chars: int) -> tuple[str, str]:
    """(status, observation text) of one call that parsed."""
    why = check_arguments(t, call.arguments)
    if why is not None:
        return INVALID, f"error: invalid arguments for {t.name}: {why}"
    ((status, value),) = run_with_timeouts([partial(t.fn, **call.arguments)], timeout_s, max_workers=1)
    if status == TIMEOUT:
        return TIMEOUT, f"error: {t.name} timed out after {timeout_s:g}s"
    if status != OK:
        return ERROR, f"error: {t.name} raised {type(value).__name__}: {value}"
    if not isinstance(value, str):
        return ERROR, f"error: {t.name} returned {type(value).__name__}, not text"
    if len(value) > max_chars:
        value = value[:max_chars] + f" [... cut at {max_chars} characters]"
    return OK, value


def run_tool_calls(calls: Sequence[ToolCall], tools: dict[str, Tool], timeout_s: float,
                   max_chars: int) -> list[ToolResult]:  # fmt: skip
    """Run the calls of one turn, in parallel, each within ``timeout_s``; one :class:`ToolResult` per call."""
    results: list[ToolResult | None] = [None] * len(calls)
    runnable = []
    for i, call in enumerate(calls):
        if call.error is not None:
            results[i] = ToolResult(call, f"error: {call.error}", INVALID)
        elif call.name not in tools:
            results[i] = ToolResult(call, f"error: unknown tool {call.name!r}; tools: {sorted(tools)}", INVALID)
        else:
            runnable.append(i)
    jobs = [partial(_call_tool, tools[calls[i].name], calls[i], timeout_s, max_chars) for i in runnable]
    # each job bounds its own call; this outer limit only guards the bookkeeping around it
    for i, (status, value) in zip(runnable, run_with_timeouts(jobs, 2 * timeout_s + 1, max_workers=len(jobs) or 1),
                                  strict=True):  # fmt: skip
        if status == OK:
            results[i] = ToolResult(calls[i], value[1], value[0])
        elif status == TIMEOUT:
            results[i] = ToolResult(calls[i], f"error: {calls[i].name} timed out after {timeout_s:g}s", TIMEOUT)
        else:  # the arguments could not even be passed (e.g. a schema the jsonschema check let through)
            results[i] = ToolResult(calls[i], f"error: {calls[i].name} raised {type(value).__name__}: {value}", ERROR)
    return results  # type: ignore[return-value]


def _messages(observation: Any) -> list[dict[str, Any]]:
    if observation is None:
        return []
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if isinstance(observation, Sequence) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in observation
    ):
        return [dict(m) for m in observation]
    raise TypeError(f"observation must be text or {{role, content}} messages, got {type(observation).__name__}")


def _user_call(fn: Any, timeout_s: float, what: str) -> Any:
    ((status, value),) = run_with_timeouts([fn], timeout_s, max_workers=1)
    if status == TIMEOUT:
        raise TimeoutError(f"{what} ran past rollout.agent.tool_timeout_s ({timeout_s:g}s)")
    if status != OK:
        raise value if isinstance(value, Exception) else RuntimeError(f"{what} exited ({value})")
    return value


def environment_turn(traj: Trajectory, turn: Turn, spec: Any, chat: Any, agent_cfg: Any) -> Outcome:
    """The environment's side of one turn (see the module docstring); never raises."""
    counts = dict.fromkeys(COUNTS, 0)
    timeout = agent_cfg.tool_timeout_s
    try:
        if traj.env is None:
            traj.env = _user_call(spec.env_cls, timeout, f"{spec.label} construction")
            _user_call(partial(traj.env.reset, dict(traj.extra_info or {})), timeout, f"{spec.label} reset()")
            traj.tools = {t.name: t for t in environment_tools(traj.env, check=False)}
        turn.tool_calls = list(spec.parser(turn.text))
        counts["tool_calls"] = len(turn.tool_calls)
        if turn.tool_calls and not turn.last:
            turn.tool_results = run_tool_calls(turn.tool_calls, traj.tools, timeout, agent_cfg.max_tool_output_chars)
            for r in turn.tool_results:
                key = {ERROR: "tool_errors", TIMEOUT: "tool_timeouts", INVALID: "invalid_calls"}.get(r.status)
                if key is not None:
                    counts[key] += 1
        step = _user_call(partial(traj.env.step, turn), timeout, f"{spec.label} step()")
        if not isinstance(step, Step):
            raise TypeError(f"step() returned {type(step).__name__}, not a Step")
        reward = 0.0 if step.reward is None else step.reward
        if not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
            raise ValueError(f"step() gave reward {step.reward!r}; it must be a finite number or None")
        messages = _messages(step.observation)
        if step.done or turn.last:
            return Outcome(None, float(reward), done=bool(step.done), counts=counts)
        end_token = turn.token_ids[-1] if turn.finish_reason == "stop" and turn.token_ids else None
        return Outcome(chat.observation_ids(messages, end_token), float(reward), counts=counts)
    except Exception as err:  # the user's environment failed: this trajectory ends, the step goes on
        counts["env_errors"] = 1
        return Outcome(None, 0.0, end=END_ERROR, counts=counts, message=f"{type(err).__name__}: {err}")
