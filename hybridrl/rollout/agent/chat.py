"""Chat rendering for multi-turn rollouts: prompts with tools, and the tokens appended between turns.

:class:`ChatFormat` owns the two places where text becomes tokens in a trajectory; everything else is the tokens
vLLM generated (token-in-token-out: the conversation is never re-tokenized from text):

- the prompt: the row's messages rendered with the tools' schemas by the tokenizer's chat template
  (``apply_chat_template(messages, tools=...)``);
- an observation: the text the chat template puts between the end of the policy's turn and the start of its
  next turn, tokenized alone. It is the difference of two renderings of a fixed stand-in conversation,
  ``[user, assistant]`` and ``[user, assistant, *observation messages]`` + generation prompt, preceded by what
  the template writes after an assistant message's content (``<|im_end|>\\n`` in ChatML) minus the end token
  the policy generated itself (``<|im_end|>``): so the appended tokens are exactly what the template would put
  there, and a template that renders earlier turns differently once more messages follow is refused up front.

Tokenizers without a chat template (sentencepiece models such as the demo's, template-less HF tokenizers) use
hybridrl's default format (:mod:`hybridrl.data.tokenizers`: ``<|role|>\\n{content}\\n`` per message), where
tools are listed in a system message (:data:`TOOLS_PROMPT`, name, arguments and description), the policy calls them in
the Hermes format (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the ``hermes`` parser) and a
tool's answer is a ``tool`` message (``<|tool|>\\n{output}\\n``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridrl.rollout.agent.interface import AgentError, Message

TOOLS_PROMPT = '# Tools\n{tools}\nCall one as <tool_call>{{"name":...,"arguments":{{...}}}}</tool_call>'
"""The system text listing the tools in hybridrl's default chat format, one line per tool:
``name(arg: type, ...): description`` (short: tiny models read every prompt token; HF chat templates get the full
JSON schemas)."""
_MARK = "hybridrl-assistant-content-3f7a"
_USER = [{"role": "user", "content": "hybridrl-user-content"}]


def hf_template(tokenizer: Any) -> Any | None:
    """The HF tokenizer behind ``tokenizer`` when it has a chat template, else None (hybridrl's default format)."""
    hf = getattr(tokenizer, "hf", None)
    return hf if hf is not None and getattr(hf, "chat_template", None) else None


def template_supports_tools(hf: Any) -> bool:
    """The chat template reads a ``tools`` variable (the ``apply_chat_template(tools=...)`` convention)."""
    import jinja2
    from jinja2 import meta

    templates = hf.chat_template if isinstance(hf.chat_template, dict) else {"default": hf.chat_template}
    template = templates.get("tool_use") or templates.get("default") or next(iter(templates.values()))
    return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))


def tool_line(schema: dict[str, Any]) -> str:
    """One tool of :data:`TOOLS_PROMPT`: ``calculator(expression: string): Evaluate arithmetic...``."""
    fn = schema["function"]
    props = fn.get("parameters", {}).get("properties", {})
    args = ", ".join(f"{k}: {v.get('type', 'any')}" for k, v in props.items())
    return f"{fn['name']}({args}): {fn.get('description', '')}"


def with_tools_system(messages: Sequence[Message], tools: Sequence[dict[str, Any]]) -> list[Message]:
    """``messages`` with :data:`TOOLS_PROMPT` as (the end of) the system message, for hybridrl's default format."""
    block = TOOLS_PROMPT.format(tools="\n".join(map(tool_line, tools)))
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{block}"
        return out
    return [{"role": "system", "content": block}, *out]


def as_messages(prompt: Any) -> list[Message]:
    """A dataset row's ``raw_prompt`` (a string: one user turn; or chat messages) as a list of messages."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


class ChatFormat:
    """Prompt and observation tokens of one tokenizer, with the tools of one environment.

    Args:
        tokenizer: a :class:`hybridrl.data.tokenizers.Tokenizer`.
        tools: the tools' schemas (:meth:`~hybridrl.rollout.agent.interface.Tool.schema`); empty = no tools.

    Raises:
        AgentError: tools with an HF chat template that has no tool support, or a template under which appended
            turns would not equal a rendering of the whole conversation.
    """

    def __init__(self, tokenizer: Any, tools: Sequence[dict[str, Any]] = ()) -> None:
        self.tokenizer = tokenizer
        self.tools = list(tools)
        self.hf = hf_template(tokenizer)
        if self.tools and self.hf is not None and not template_supports_tools(self.hf):
            raise AgentError(
                f"rollout.agent: the environment has tools ({[t['function']['name'] for t in self.tools]}) but the "
                f"chat template of {getattr(self.hf, 'name_or_path', '') or 'the tokenizer'} has no tool support "
                "(it never reads `tools`); use a tokenizer whose template renders tools (Qwen2.5, Llama 3.1, Hermes), "
                "set model.tokenizer_path to one, or use an environment without tools"
            )
        self._head = self._render([*_USER, {"role": "assistant", "content": _MARK}], False)
        self._closing = self._head[self._head.rindex(_MARK) + len(_MARK) :]
        # what the template writes after an assistant turn's content, once the turn's end token was generated
        self._closing_after: dict[int, str] = {}
        self.observation_text([{"role": "tool", "name": "probe", "content": "probe"}], None)  # refuses bad templates

    def _render(self, messages: Sequence[Message], add_generation_prompt: bool, tools: Any = None) -> str:
        if self.hf is not None:
            return self.hf.apply_chat_template(
                list(messages), tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        msgs = with_tools_system(messages, tools) if tools else list(messages)
        return self.tokenizer.render_chat(msgs, add_generation_prompt)

    def prompt_text(self, messages: Sequence[Message]) -> str:
        """The prompt: ``messages`` and the tools rendered by the chat template, with the generation prompt."""
        return self._render(messages, True, self.tools)

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """Token ids of :meth:`prompt_text`."""
        return self.tokenizer.encode(self.prompt_text(messages))

    def _closing_text(self, last_token: int | None) -> str:
        if last_token is None:
            return self._closing
        if last_token not in self._closing_after:
            text = self.tokenizer.decode([last_token], skip_special_tokens=False)
            after = self._closing[len(text) :] if text and self._closing.startswith(text) else self._closing
            self._closing_after[last_token] = after
        return self._closing_after[last_token]

    def observation_text(self, messages: Sequence[Message], end_token: int | None) -> str:
        """The text between a policy turn and the next: the rest of the turn's closing, ``messages``, and the
        generation prompt of the next assistant turn.

        Args:
            messages: the observation as chat messages (may be empty).
            end_token: the end token the turn stopped on (it is part of the turn already), or None when the turn
                stopped on its length limit.

        Raises:
            AgentError: the template renders the stand-in conversation differently once ``messages`` follow.
        """
        base = [*_USER, {"role": "assistant", "content": _MARK}]
        full = self._render([*base, *messages], True)
        if not full.startswith(self._head):
            raise AgentError(
                "rollout.agent: the chat template renders an assistant turn differently once tool or user messages "
                "follow it, so appending observation tokens would not equal the rendered conversation; use a template "
                "that renders earlier turns unchanged (Qwen2.5, Hermes, ChatML)"
            )
        return self._closing_text(end_token) + full[len(self._head) :]

    def observation_ids(self, messages: Sequence[Message], end_token: int | None) -> list[int]:
        """Token ids of :meth:`observation_text`, tokenized alone (what is appended to the trajectory)."""
        return self.tokenizer.encode(self.observation_text(messages, end_token))
