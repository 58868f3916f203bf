"""What a user implements for multi-turn rollouts: an :class:`Environment` and its tools.

One environment object serves one trajectory. The agent loop constructs it without arguments, calls
:meth:`Environment.reset` with the prompt row's ``extra_info``, then :meth:`Environment.step` after every
policy turn. A step answers with a :class:`Step`: an observation (text, or chat messages), an optional reward
and ``done``. Tools are methods (or functions) marked with :func:`tool`; each has a JSON schema (given, or
derived from its signature and Google-style docstring) that is rendered into the prompt through the
tokenizer's chat template, and the loop runs the calls the policy writes (parsed by
:mod:`hybridrl.rollout.agent.parsers`) before :meth:`Environment.step` sees the turn.

A minimal tool environment::

    class Calculator(Environment):
        @tool
        def add(self, a: int, b: int) -> str:
            \"\"\"Add two integers.

            Args:
                a: first term.
                b: second term.
            \"\"\"
            return str(a + b)

        def reward(self, turn: Turn) -> float:
            return float(turn.text.strip() == str(self.extra_info["answer"]))

The default :meth:`Environment.step` returns the tool results as ``tool`` messages while the policy calls
tools, and ends the trajectory with :meth:`Environment.reward` on the first turn without a call.

This module also owns :class:`AgentError`, the one-line error of a bad environment, tool or agent setting.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Union, get_args, get_origin, get_type_hints

from hybridrl.errors import InputError

Message = dict[str, Any]
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""Tool names the chat templates and the OpenAI function-calling format accept."""
OK, ERROR, TIMEOUT, INVALID = "ok", "error", "timeout", "invalid"
""":attr:`ToolResult.status` values: ran and returned text; raised or returned non-text; ran past
``rollout.agent.tool_timeout_s``; a call that could not be made (malformed, unknown tool, bad arguments)."""


class AgentError(InputError, ValueError):
    """A multi-turn rollout setting that cannot run (environment file, tool schema, chat template, limits); the
    one-line message names the ``rollout.agent`` key, the value and the fix."""


@dataclass
class ToolCall:
    """One call the policy wrote, as the parser read it."""

    name: str
    """The tool's name ("" when the call could not be parsed)."""
    arguments: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the call."""
    error: str | None = None
    """Why the call is malformed (bad JSON, no name, ...); None for a well-formed call."""
    raw: str = ""
    """The call's text as the policy wrote it."""


@dataclass
class ToolResult:
    """What one call gave: the text the policy reads next, and how it went."""

    call: ToolCall
    content: str
    """The observation text (the tool's output, or an ``error: ...`` line)."""
    status: str = OK
    """One of :data:`OK`, :data:`ERROR`, :data:`TIMEOUT`, :data:`INVALID`."""


@dataclass
class Turn:
    """One policy turn, handed to :meth:`Environment.step`."""

    index: int
    """0 for the first turn."""
    text: str
    """The turn decoded (special tokens dropped); for reading only: the trained tokens are ``token_ids``."""
    token_ids: list[int]
    """The tokens vLLM generated in this turn."""
    finish_reason: str
    """vLLM's: "stop" (an end token) or "length" (the turn's token limit)."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    """Calls parsed from ``text``."""
    tool_results: list[ToolResult] = field(default_factory=list)
    """One result per call, in order; empty on the last turn (nothing would read them)."""
    last: bool = False
    """No turn follows, whatever the step returns (``max_turns`` reached or the token budget spent)."""


@dataclass
class Step:
    """The environment's answer to a turn."""

    observation: str | Sequence[Message] | None = None
    """Text (one ``user`` message) or chat messages, rendered between this turn and the next; None = none."""
    reward: float | None = None
    """Reward for this turn; a trajectory's rewards are summed and given at its last policy token."""
    done: bool = False
    """The trajectory ends after this turn, finished (end reason "done"); a last turn (:attr:`Turn.last`) ends
    anyway, with reason "max_turns" or "budget" unless done."""


@dataclass(frozen=True)
class Tool:
    """A function the policy may call, with its JSON schema."""

    name: str
    description: str
    parameters: dict[str, Any]
    """JSON schema of the keyword arguments (``{"type": "object", "properties": ..., "required": ...}``)."""
    fn: Callable[..., Any]

    def schema(self) -> dict[str, Any]:
        """The OpenAI / chat-template form: ``{"type": "function", "function": {name, description, parameters}}``."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


_TOOL_ATTR = "__hybridrl_tool__"
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def tool(fn: Callable | None = None, *, name: str | None = None, description: str | None = None,
         parameters: dict[str, Any] | None = None) -> Any:  # fmt: skip
    """Mark a function or an :class:`Environment` method as a tool.

    Used bare (``@tool``) the schema is derived from the signature (``str``, ``int``, ``float``, ``bool``,
    ``list``, ``dict`` annotations; parameters without a default are required) and the docstring (first
    paragraph: the description; ``Args:`` lines: the parameters' descriptions). ``parameters`` gives the JSON
    schema of the arguments instead.
    """

    def mark(f: Callable) -> Callable:
        setattr(f, _TOOL_ATTR, {"name": name, "description": description, "parameters": parameters})
        return f

    return mark(fn) if fn is not None else mark


def _doc_parts(fn: Callable) -> tuple[str, dict[str, str]]:
    doc = inspect.getdoc(fn) or ""
    summary = doc.split("\n\n")[0].replace("\n", " ").strip()
    args, in_args = {}, False
    for line in doc.splitlines():
        if line.strip() in ("Args:", "Arguments:"):
            in_args = True
            continue
        if in_args and line and not line.startswith(" "):
            break  # the next section
        match = re.match(r"\s+(\w+)(?:\s*\([^)]*\))?:\s*(.*)", line) if in_args else None
        if match:
            args[match.group(1)] = match.group(2).strip()
    return summary, args


def _json_type(annotation: Any) -> str | None:
    if get_origin(annotation) is Union:  # Optional[X] / X | None
        inner = [a for a in get_args(annotation) if a is not type(None)]
        annotation = inner[0] if len(inner) == 1 else None
    return _JSON_TYPES.get(get_origin(annotation) or annotation)


def derive_parameters(fn: Callable) -> dict[str, Any]:
    """JSON schema of ``fn``'s keyword arguments from its signature and docstring (``self`` skipped)."""
    _, docs = _doc_parts(fn)
    try:
        hints = get_type_hints(fn)
    except Exception:  # unresolvable forward references: annotations are then only documentation
        hints = {}
    props, required = {}, []
    for p in inspect.signature(fn).parameters.values():
        if p.name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        prop: dict[str, Any] = {}
        kind = _json_type(hints.get(p.name, p.annotation))
        if kind:
            prop["type"] = kind
        if p.name in docs:
            prop["description"] = docs[p.name]
        props[p.name] = prop
        if p.default is p.empty:
            required.append(p.name)
    return {"type": "object", "properties": props, "required": required}


def make_tool(fn: Callable, where: str = "", check: bool = True) -> Tool:
    """The :class:`Tool` of a function marked with :func:`tool` (or of any function), its schema checked unless
    ``check`` is False (the loop's per-trajectory copies of tools checked at start-up).

    Raises:
        AgentError: a name the chat formats refuse, or parameters that are not a valid JSON schema.
    """
    spec = getattr(fn, _TOOL_ATTR, None) or {}
    summary, _ = _doc_parts(fn)
    t = Tool(
        name=spec.get("name") or fn.__name__,
        description=spec.get("description") or summary,
        parameters=spec.get("parameters") if spec.get("parameters") is not None else derive_parameters(fn),
        fn=fn,
    )
    if check:
        check_tool_schema(t, where)
    return t


def check_tool_schema(t: Tool, where: str = "") -> None:
    """``t``'s name is ``[A-Za-z0-9_-]{1,64}`` and its parameters are a JSON-serialisable, valid JSON schema of an
    object (checked against the JSON Schema meta-schema with ``jsonschema``).

    Raises:
        AgentError: naming the tool, what is wrong and the fix.
    """
    label = f"tool {t.name!r}{f' of {where}' if where else ''}"
    if not TOOL_NAME.match(t.name):
        raise AgentError(f"{label}: the name must match [A-Za-z0-9_-]{{1,64}} (chat templates' rule); rename it")
    params = t.parameters
    try:
        json.dumps(params)
    except (TypeError, ValueError) as err:
        raise AgentError(
            f"{label}: its parameters schema is not JSON ({err}); use dicts, lists, strings and numbers"
        ) from None
    if not isinstance(params, dict) or params.get("type") != "object":
        raise AgentError(
            f'{label}: its parameters schema must be an object schema ({{"type": "object", '
            f'"properties": {{...}}}}), got {json.dumps(params)[:120]}; fix @tool(parameters=...)'
        )
    try:
        import jsonschema
    except ImportError:  # the structural checks above still hold
        return
    try:
        jsonschema.validators.validator_for(params).check_schema(params)
    except jsonschema.SchemaError as err:
        path = "/".join(str(p) for p in err.absolute_path) or "(top)"
        raise AgentError(
            f"{label}: its parameters are not a valid JSON schema at {path}: {err.message}; fix @tool(parameters=...)"
        ) from None


def check_arguments(t: Tool, arguments: dict[str, Any]) -> str | None:
    """Why ``arguments`` do not fit ``t``'s schema (one line), or None when they do."""
    try:
        import jsonschema
    except ImportError:
        missing = [k for k in t.parameters.get("required", []) if k not in arguments]
        return f"missing argument {missing[0]!r}" if missing else None
    try:
        jsonschema.validate(arguments, t.parameters)
    except jsonschema.ValidationError as err:
        where = "/".join(str(p) for p in err.absolute_path)
        return f"{err.message}{f' (at {where})' if where else ''}"
    return None


class Environment:
    """One trajectory's environment: subclass it, override :meth:`step` (or :meth:`reward`), add :func:`tool`
    methods. Constructed without arguments (once per trajectory, and once at start-up as a check)."""

    extra_info: dict[str, Any]

    def reset(self, extra_info: dict[str, Any]) -> None:
        """Start a trajectory on the prompt row's ``extra_info`` (a dict; empty when the row has none)."""
        self.extra_info = extra_info

    def step(self, turn: Turn) -> Step:
        """Answer a policy turn. Default: tool results as ``tool`` messages while the policy calls tools; the
        first turn without a call ends the trajectory (done) with :meth:`reward`. A last turn that still calls
        tools gets its :meth:`reward` too, but is not done: the trajectory was cut (``max_turns`` or budget)."""
        if turn.tool_calls:
            return Step(reward=self.reward(turn)) if turn.last else Step(observation=tool_messages(turn.tool_results))
        return Step(reward=self.reward(turn), done=True)

    def reward(self, turn: Turn) -> float | None:
        """The reward of the trajectory ending with ``turn``; None = none (a scorer or reward model gives it)."""
        return None

    def tools(self) -> list[Tool | Callable[..., Any]]:
        """The tools of this environment: its :func:`tool` methods, bound to this object. An override may return
        :class:`Tool` objects or functions (their schemas derived as :func:`tool` does)."""
        return [getattr(self, name) for name in tool_names(type(self))]


def environment_tools(env: Any, check: bool = True) -> list[Tool]:
    """``env.tools()`` as :class:`Tool` objects (functions wrapped by :func:`make_tool`).

    Raises:
        AgentError: two tools of one name, or a schema :func:`check_tool_schema` refuses (when ``check``).
    """
    where = type(env).__name__
    tools = [t if isinstance(t, Tool) else make_tool(t, where, check=False) for t in (env.tools() or [])]
    if check:
        for t in tools:
            check_tool_schema(t, where)
    names = [t.name for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise AgentError(f"{where} has two tools named {dup!r}; give each tool its own name")
    return tools


def tool_names(cls: type) -> list[str]:
    """Names of the :func:`tool` methods of ``cls`` (in definition order, base classes first)."""
    names: list[str] = []
    for klass in reversed(cls.__mro__):
        for name, value in vars(klass).items():
            if callable(value) and hasattr(value, _TOOL_ATTR) and name not in names:
                names.append(name)
    return names


def tool_messages(results: Sequence[ToolResult]) -> list[Message]:
    """Chat messages of tool results: ``{"role": "tool", "name": <tool>, "content": <text>}`` each."""
    return [{"role": "tool", "name": r.call.name or "invalid", "content": r.content} for r in results]
