"""``actor.moe.routing_replay``: refused in one line, before any model is built, where routes cannot exist or be
followed (dense model, multi-turn agent rollout, packed prompt sharing, activation recompute); the tiny MoE config
(the demo task's Qwen3-MoE) with replay validates."""

from __future__ import annotations

import pytest

from hybridrl.config import ConfigError, load_config
from hybridrl.config.checks_routing import records_routes

REPLAY = "actor.moe.routing_replay=true"


def _error(name: str, overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(name, overrides)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_replay_validates_on_a_tiny_moe():
    cfg = load_config("tiny_cpu_moe.yaml", [REPLAY])
    assert cfg.actor.moe.routing_replay and cfg.actor.moe.routing_metric
    assert records_routes(cfg.actor, cfg.rollout, is_moe=True)
    assert not records_routes(cfg.actor, cfg.rollout, is_moe=False)


def test_replay_refusals_name_the_key_and_the_fix():
    msg = _error("ppo_llama2_7b.yaml", [REPLAY])
    assert msg.startswith("actor.moe.routing_replay (true) needs a mixture-of-experts model"), msg
    assert "set actor.moe.routing_replay=false" in msg
    base = ["tiny_cpu_moe.yaml", [REPLAY]]
    msg = _error(base[0], [*base[1], "rollout.agent.env=calculator"])
    assert "the agent loop (rollout.agent.env='calculator') records none" in msg, msg
    msg = _error(base[0], [*base[1], "actor.share_prompt_prefix=true"])
    assert "set actor.share_prompt_prefix=false" in msg, msg
    msg = _error(
        base[0],
        [
            *base[1],
            "actor.megatron.recompute_granularity=full",
            "actor.megatron.recompute_method=uniform",
            "actor.megatron.recompute_num_layers=1",
        ],
    )
    assert "recompute_granularity 'full'" in msg and "=null" in msg, msg


def test_metric_alone_needs_no_replay_conditions():
    cfg = load_config("tiny_cpu_moe.yaml", ["actor.share_prompt_prefix=true"])
    assert cfg.actor.moe.routing_metric and not cfg.actor.moe.routing_replay
    agent = load_config("tiny_cpu_moe.yaml", ["rollout.agent.env=calculator"])
    assert not records_routes(agent.actor, agent.rollout, is_moe=True)  # the agent loop records no routes
