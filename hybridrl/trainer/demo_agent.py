"""The agent demos of ``data.demo_task``: a built-in environment's task, its tokenizer text and warm-up traces.

With ``rollout.agent.env`` "calculator" (``configs/tiny_cpu_agent.yaml``) or "guess_number" and no
``rollout.agent.path``, :func:`hybridrl.trainer.demo_assets.make_demo_assets` writes that environment's task
(:func:`~hybridrl.rollout.agent.envs.calculator.make_calculator_task`,
:func:`~hybridrl.rollout.agent.envs.guess_number.make_guess_task`) and warms the tiny model up on traces
tokenized exactly as the agent loop builds trajectories: the prompt rendered with the tools, each policy turn +
EOS (loss mask 1), each observation (a tool's output, the environment's reply) as the loop appends it (mask 0).

Calculator traces call the tool with the question's expression and answer with its output; a share of them
(:data:`DIRECT_SHARE`) answers at once with a lazy guess (the question's first number), so that the warmed-up
policy calls the tool only part of the time and GRPO has something to learn: that the call pays. Number-guessing
traces are binary searches.
"""

from __future__ import annotations

import random
import re
from typing import Any

from hybridrl.rollout.agent.envs.calculator import CALL_CLOSE, CALL_OPEN

AGENT_DEMOS = ("calculator", "guess_number")
"""Environments with a demo task."""
AGENT_WARMUP_STEPS = 300
"""Supervised warm-up batches of the agent demos (``$HYBRIDRL_DEMO_WARMUP_STEPS`` overrides): at
:data:`AGENT_WARMUP_LR` the 2-layer demo model learns to copy the expression into its call after 150-250 batches of
32 (seeds 1-3), ~40-90 s of one CPU core."""
AGENT_WARMUP_LR = 1e-3
"""AdamW learning rate of the agent warm-up. The copy demo's 3e-3 leaves the 2-layer model on a plateau (loss
~1.35 after 600 batches, no call copies its expression): the prompt's tools block gives attention ~40 more tokens
to spread over before it finds the question's digits."""
AGENT_VOCAB = 1024
"""Largest sentencepiece vocabulary of the agent demos (a small corpus yields fewer pieces)."""
AGENT_SYMBOLS = (CALL_OPEN, CALL_CLOSE, "<tool_call>", "</tool_call>", "<|tool|>")
"""Single tokens of the demo tokenizer: the calculator call around its expression, the Hermes tags and the
tool role of hybridrl's default chat format (:mod:`hybridrl.rollout.agent.chat`)."""
DIRECT_SHARE = 0.5
"""Share of calculator warm-up traces that answer without the tool (a lazy guess, nearly always wrong)."""

Trace = list[tuple[str, list[dict[str, Any]] | None]]
"""Policy turns, each with the observation messages that follow it (None after the last)."""


def agent_rows(env: str, n: int, seed: int, split: str) -> list[dict[str, Any]]:
    """``n`` rows of ``env``'s demo task."""
    if env == "calculator":
        from hybridrl.rollout.agent.envs.calculator import make_calculator_task

        return make_calculator_task(n, seed=seed, split=split, plain=True)
    from hybridrl.rollout.agent.envs.guess_number import make_guess_task

    return make_guess_task(n, seed=seed, split=split)


def tool_schemas(env: str) -> list[dict[str, Any]]:
    """The schemas of ``env``'s tools (rendered into every prompt)."""
    from hybridrl.rollout.agent.interface import environment_tools
    from hybridrl.rollout.agent.registry import environment_class

    cls, _ = environment_class(env, None)
    return [t.schema() for t in environment_tools(cls())]


def trace(env: str, row: dict[str, Any], direct: bool = False) -> Trace:
    """The demonstration of one row (``direct``: the calculator's lazy guess instead of the tool)."""
    info = row["extra_info"]
    if env == "calculator":
        from hybridrl.rollout.agent.envs.calculator import demo_turns

        if direct:
            return [(re.match(r"\d+", info["expression"]).group(0), None)]
        return [(text, None if out is None else [{"role": "tool", "name": "calculator", "content": out}])
                for text, out in demo_turns(row)]  # fmt: skip
    low, high, target, turns = info.get("low", 1), info.get("high", 100), info["target"], []
    while True:
        guess = (low + high) // 2
        if guess == target:
            return [*turns, (str(guess), None)]
        reply = "Higher." if guess < target else "Lower."
        turns.append((str(guess), [{"role": "user", "content": reply}]))
        low, high = (guess + 1, high) if guess < target else (low, guess - 1)


def agent_texts(env: str, rows: list[dict[str, Any]]) -> list[str]:
    """Sentences to train the demo tokenizer on: prompts rendered with the tools, turns, observations."""
    from hybridrl.data.tokenizers import render_default_chat
    from hybridrl.rollout.agent.chat import with_tools_system

    tools = tool_schemas(env)
    texts = [render_default_chat(with_tools_system(r["prompt"], tools) if tools else r["prompt"]) for r in rows]
    for r in rows:
        for text, obs in trace(env, r):
            texts += [text, *(m["content"] for m in obs or [])]
    return [*texts, "0123456789+-*/()", "Say one whole number between 1 and 100."]


def agent_examples(env: str, tok: Any, rows: list[dict[str, Any]], seed: int) -> list[tuple[list[int], list[int]]]:
    """``(ids, loss mask)`` warm-up examples (see the module docstring)."""
    from hybridrl.rollout.agent.chat import ChatFormat

    chat, rng, eos = ChatFormat(tok, tool_schemas(env)), random.Random(seed), tok.eos_token_id
    examples = []
    for row in rows:
        ids = chat.prompt_ids(row["prompt"])
        mask = [0] * len(ids)
        for text, obs in trace(env, row, direct=env == "calculator" and rng.random() < DIRECT_SHARE):
            turn = [*tok.encode(text), eos]
            ids, mask = ids + turn, mask + [1] * len(turn)
            if obs is not None:
                more = chat.observation_ids(obs, eos)
                ids, mask = ids + more, mask + [0] * len(more)
        examples.append((ids, mask))
    return examples
