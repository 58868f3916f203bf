"""Where ``reward.overlap_generation`` resolves on (:func:`hybridrl.config.checks_overlap.overlap_enabled`): the
packaged configs with the overrides users type. Multi-turn rollouts and Ray mode stream their rewards too; a run
without a rule-based scorer (a reward model, or only the environment's reward) does not."""

from __future__ import annotations

import pytest

from hybridrl.config import ConfigError, load_config
from hybridrl.config.checks_overlap import overlap_enabled

AGENT = "tiny_cpu_agent.yaml"
SCORER = ["reward.scorer=auto", "reward.custom.path=tests/trainer/agent_scorer.py"]


@pytest.mark.parametrize(
    ("name", "overrides", "on"),
    [
        ("tiny_cpu.yaml", [], True),
        (AGENT, SCORER, True),  # each trajectory scored as its episode ends
        (AGENT, [*SCORER, "reward.overlap_generation=false"], False),
        (AGENT, [], False),  # reward.scorer null: only the environment's reward
        (AGENT, ["reward.model.enable=true", "reward.model.path=rm"], False),  # a reward model scores whole batches
        (AGENT, [*SCORER, "trainer.launcher=ray", "trainer.save_freq=-1"], True),
        ("tiny_cpu.yaml", ["trainer.launcher=ray"], True),
    ],
    ids=["single_turn", "agent", "agent_off", "agent_env_reward_only", "agent_reward_model", "agent_ray", "ray"],
)
def test_overlap_resolves(name, overrides, on):
    assert overlap_enabled(load_config(name, overrides, world_size=2)) is on


def test_true_on_an_agent_run_without_a_scorer_names_the_key():
    with pytest.raises(ConfigError) as info:
        load_config(AGENT, ["reward.overlap_generation=true"], world_size=2)
    assert str(info.value) == (
        "reward.overlap_generation (true) does not apply here: reward.scorer is null (no rule-based scorer to run); "
        "set it to null (auto) or false"
    )
    assert overlap_enabled(load_config(AGENT, [*SCORER, "reward.overlap_generation=true"], world_size=2))
