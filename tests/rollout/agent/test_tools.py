"""Environments and tools without an engine: the hermes parser, tool schemas, tool calls (answered, malformed,
raising, non-text, hanging), the calculator's parser, the built-in environments and the loader's one-line errors.
"""

from __future__ import annotations

import time
from fractions import Fraction

import pytest

from hybridrl.config.schema_roles import AgentConfig
from hybridrl.rollout.agent import AgentError, Environment, Step, Turn, tool
from hybridrl.rollout.agent.envs.calculator import CalculatorEnvironment, CalculatorError, evaluate
from hybridrl.rollout.agent.envs.guess_number import GuessNumberEnvironment
from hybridrl.rollout.agent.episode import Trajectory, environment_turn, run_tool_calls
from hybridrl.rollout.agent.interface import ERROR, INVALID, OK, TIMEOUT, Tool, check_tool_schema, environment_tools
from hybridrl.rollout.agent.parsers import parse_hermes
from hybridrl.rollout.agent.registry import load_agent


def test_hermes_parser_reads_calls_and_names_malformed_ones():
    text = 'x <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call> y '
    text += '<tool_call>\n{"name": "f", "arguments": "{\\"b\\": 2}"}\n</tool_call>'  # arguments as a JSON string
    calls = parse_hermes(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [("add", {"a": 1}, None), ("f", {"b": 2}, None)]
    assert parse_hermes("no call here") == []
    bad = {
        "<tool_call>{not json}</tool_call>": "not valid JSON",
        "<tool_call>[1, 2]</tool_call>": "must be a JSON object",
        '<tool_call>{"arguments": {}}</tool_call>': 'no "name"',
        '<tool_call>{"name": "f", "arguments": 3}</tool_call>': '"arguments" must be an object',
        '<tool_call>{"name": "f", "arguments": {}}': "no closing </tool_call>",
    }
    for text, why in bad.items():
        (call,) = parse_hermes(text)
        assert call.error is not None and why in call.error, (text, call.error)


def test_calculator_parses_never_evals():
    assert evaluate("(12 + 30) * 2") == 84
    assert evaluate("7 / 2 - -1") == Fraction(9, 2)
    assert evaluate("2 + 3 * 4 - 6 / 3") == 12  # precedence
    refused = {"__import__('os')": "unexpected character", "2 ** 3": "unexpected '*'", "(1 + 2": "ends too early",
               "1 / 0": "division by zero", "1 2": "unexpected '2'", "": "empty", "9" * 201: "longer"}  # fmt: skip
    for bad, why in refused.items():
        with pytest.raises(CalculatorError, match=why):
            evaluate(bad)
    env = CalculatorEnvironment()
    (t,) = environment_tools(env)
    assert t.name == "calculator" and t.parameters["required"] == ["expression"]
    env.reset({"answer": "85"})
    assert env.reward(Turn(1, "It is 85.", [], "stop")) == 1.0
    assert env.reward(Turn(1, "It is 84.", [], "stop")) == 0.0


class _Tools(Environment):
    @tool
    def echo(self, text: str) -> str:
        """Echo text.

        Args:
            text: what to say.
        """
        return text

    @tool
    def boom(self) -> str:
        """Raise."""
        raise RuntimeError("kaput")

    @tool
    def number(self) -> str:
        """Return a number, not text."""
        return 3  # type: ignore[return-value]

    @tool
    def hang(self) -> str:
        """Sleep past the timeout."""
        time.sleep(5)
        self.hang_returned = True
        return "late"


def test_tool_calls_become_observations_never_crashes():
    env = _Tools()
    tools = {t.name: t for t in environment_tools(env)}
    assert tools["echo"].parameters == {
        "type": "object", "properties": {"text": {"type": "string", "description": "what to say."}},
        "required": ["text"],
    }  # fmt: skip
    text = "".join(f"<tool_call>{c}</tool_call>" for c in (
        '{"name": "echo", "arguments": {"text": "hi"}}', '{"name": "boom", "arguments": {}}',
        '{"name": "number", "arguments": {}}', '{"name": "hang", "arguments": {}}', '{"name": "nope", "arguments": {}}',
        '{"name": "echo", "arguments": {"text": 5}}', "{oops}",
    ))  # fmt: skip
    results = run_tool_calls(parse_hermes(text), tools, timeout_s=0.3, max_chars=100)
    assert not getattr(env, "hang_returned", False)  # the hanging call was abandoned at its timeout, not waited for
    assert [r.status for r in results] == [OK, ERROR, ERROR, TIMEOUT, INVALID, INVALID, INVALID]
    assert results[0].content == "hi"
    assert "RuntimeError: kaput" in results[1].content and "returned int, not text" in results[2].content
    assert "timed out after 0.3s" in results[3].content and "unknown tool 'nope'" in results[4].content
    assert "invalid arguments for echo" in results[5].content and "not valid JSON" in results[6].content


def test_environment_turn_counts_and_ends_on_failure():
    class Chat:  # the observation's tokens are the chat format's business (tested with the loop)
        def observation_ids(self, messages, end_token):
            return [len(m["content"]) for m in messages]

    spec = load_agent(AgentConfig(path=__file__, env="_Tools"))
    cfg = AgentConfig(tool_timeout_s=0.3)
    traj = Trajectory(0, [1], {}, None)
    text = '<tool_call>{"name": "echo", "arguments": {"text": "hey"}}</tool_call>'
    text += '<tool_call>{"name": "hang", "arguments": {}}</tool_call>'
    out = environment_turn(traj, Turn(0, text, [7], "stop"), spec, Chat(), cfg)
    assert out.end is None and out.observation_ids == [3, len("error: hang timed out after 0.3s")]
    assert out.counts["tool_calls"] == 2 and out.counts["tool_timeouts"] == 1
    out = environment_turn(traj, Turn(1, "done now", [7], "stop"), spec, Chat(), cfg)  # default step: no call ends
    assert out.observation_ids is None and out.done

    class Broken(Environment):
        def step(self, turn: Turn) -> Step:
            return "not a step"  # type: ignore[return-value]

    spec.env_cls = Broken
    out = environment_turn(Trajectory(1, [1], {}, None), Turn(0, "x", [7], "stop"), spec, Chat(), cfg)
    assert out.end == "error" and out.counts["env_errors"] == 1 and "not a Step" in out.message


def test_guess_number_replies_and_rewards():
    env = GuessNumberEnvironment()
    env.reset({"target": 42})
    assert env.step(Turn(0, "50", [], "stop")).observation == "Lower."
    assert env.step(Turn(1, "I say 30", [], "stop")).observation == "Higher."
    assert "whole number" in env.step(Turn(2, "hmm", [], "stop")).observation
    step = env.step(Turn(3, "42", [], "stop"))
    assert step.done and step.reward == pytest.approx(0.7)


BAD_FILES = {
    "import nonexistent_module_xyz\n": "failed to import (ModuleNotFoundError",
    "X = 1\n": "defines none Environment subclasses",
    "from hybridrl.rollout.agent import Environment\nclass E(Environment):\n    def __init__(self):\n"
    "        raise OSError('no db')\n": "raised when constructed (OSError: no db)",
    "from hybridrl.rollout.agent import Environment, tool\nclass E(Environment):\n"
    "    @tool(parameters={'type': 'object', 'properties': {'x': {'type': 'strin'}}})\n"
    "    def f(self, x):\n        return x\n": "not a valid JSON schema at properties/x/type",
    "class E:\n    def reset(self, extra_info):\n        pass\n": "it lacks step(), tools()",
}


def test_bad_environment_files_are_one_line_errors(tmp_path):
    for i, (source, why) in enumerate(BAD_FILES.items()):
        path = tmp_path / f"env{i}.py"
        path.write_text(source)
        env = "E" if "class E" in source else None
        with pytest.raises(AgentError, match=r"rollout\.agent") as err:
            load_agent(AgentConfig(path=str(path), env=env))
        assert why in str(err.value) and "\n" not in str(err.value), str(err.value)
    with pytest.raises(AgentError, match=r"rollout.agent.env \('nope'\) is not a registered environment"):
        load_agent(AgentConfig(env="nope"))
    with pytest.raises(AgentError, match=r"rollout.agent.tool_parser \('xml'\)"):
        load_agent(AgentConfig(env="calculator", tool_parser="xml"))
    with pytest.raises(AgentError, match="must match"):
        check_tool_schema(Tool("bad name", "", {"type": "object"}, print))
    assert load_agent(AgentConfig()) is None  # single-turn
