"""Tool-call parsers: a policy turn's text -> the :class:`~hybridrl.rollout.agent.interface.ToolCall` objects in it.

A parser is ``fn(text) -> list[ToolCall]``, registered by name (``rollout.agent.tool_parser``) with
:func:`register_parser`; an environment file may register its own before the loop looks the name up. A call that
cannot be read is still returned, with :attr:`ToolCall.error` set: the loop answers it with an ``error: ...``
observation (and counts it) rather than ignoring it, so the policy learns what a malformed call gives.

Built in: ``hermes``, the format of Hermes-2-Pro, Qwen2.5 / Qwen3 and hybridrl's own chat format (what
:mod:`hybridrl.rollout.agent.chat` renders for tokenizers without a chat template)::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 7"}}
    </tool_call>

Each ``<tool_call>...</tool_call>`` block holds one JSON object with a string ``name`` and an ``arguments`` object
(a JSON string holding an object is accepted too, as some models write it); a ``<tool_call>`` without its closing
tag is a malformed call.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from hybridrl.rollout.agent.interface import AgentError, ToolCall

Parser = Callable[[str], list[ToolCall]]
_PARSERS: dict[str, Parser] = {}

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


def register_parser(name: str) -> Callable[[Parser], Parser]:
    """Register ``fn(text) -> list[ToolCall]`` under ``name`` (``rollout.agent.tool_parser``).

    Raises:
        ValueError: ``name`` is already taken by another function.
    """

    def add(fn: Parser) -> Parser:
        if _PARSERS.get(name, fn) is not fn:
            raise ValueError(f"tool parser {name!r} is already registered; pick another name")
        _PARSERS[name] = fn
        return fn

    return add


def get_parser(name: str) -> Parser:
    """The parser registered as ``name``.

    Raises:
        AgentError: no parser of that name (the message lists the registered ones).
    """
    if name not in _PARSERS:
        raise AgentError(
            f"rollout.agent.tool_parser ({name!r}) is not a registered parser (known: {sorted(_PARSERS)}); set one of "
            "them, or register yours with hybridrl.rollout.agent.register_parser in the rollout.agent.path file"
        )
    return _PARSERS[name]


def _one_call(body: str, raw: str) -> ToolCall:
    try:
        obj = json.loads(body.strip())
    except ValueError as err:
        return ToolCall("", error=f"the tool call is not valid JSON ({err.msg} at char {err.pos})", raw=raw)
    if not isinstance(obj, dict):
        return ToolCall("", error=f"the tool call must be a JSON object, got {type(obj).__name__}", raw=raw)
    name, args = obj.get("name"), obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(name, str) or not name:
        return ToolCall("", error='the tool call has no "name" string', raw=raw)
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return ToolCall(name, error='"arguments" is a string that is not JSON', raw=raw)
    if not isinstance(args, dict):
        return ToolCall(name, error=f'"arguments" must be an object, got {type(args).__name__}', raw=raw)
    return ToolCall(name, args, raw=raw)


@register_parser("hermes")
def parse_hermes(text: str) -> list[ToolCall]:
    """Every ``<tool_call>{json}</tool_call>`` block of ``text``, in order; an unclosed ``<tool_call>`` is one
    malformed call."""
    calls, end = [], 0
    for match in _BLOCK.finditer(text):
        calls.append(_one_call(match.group(1), match.group(0)))
        end = match.end()
    rest = text[end:]
    if TOOL_CALL_OPEN in rest:
        raw = rest[rest.index(TOOL_CALL_OPEN) :]
        calls.append(ToolCall("", error=f"the tool call has no closing {TOOL_CALL_CLOSE}", raw=raw))
    return calls
