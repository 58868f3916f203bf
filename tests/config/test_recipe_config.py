"""The recipe configs: what ``hybridrl sft`` / ``dpo`` build (roles on or off) and their one-line config errors."""

from __future__ import annotations

import pytest

from hybridrl.config import ConfigError, load_config
from hybridrl.config.checks_recipes import load_recipe_config


def _error(recipe: str, *overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_recipe_config(recipe, f"tiny_cpu_{recipe}.yaml", list(overrides))
    assert "\n" not in str(info.value)
    return str(info.value)


def test_packaged_recipe_configs_build_only_what_the_recipe_needs():
    sft = load_recipe_config("sft", "tiny_cpu_sft.yaml")
    assert not sft.critic.enable and not sft.ref.enable and sft.actor.megatron.dp_size == 1
    dpo = load_recipe_config("dpo", "tiny_cpu_dpo.yaml")
    assert dpo.ref.enable and not dpo.critic.enable
    assert dpo.ref.log_prob_micro_batch_size_per_gpu == dpo.actor.ppo_micro_batch_size_per_gpu
    assert not load_recipe_config("dpo", "tiny_cpu_dpo.yaml", ["dpo.loss_type=simpo"]).ref.enable  # reference-free
    load_config("tiny_cpu_dpo.yaml")  # a PPO run of the same file ignores the recipe sections


@pytest.mark.parametrize(
    ("recipe", "override", "message"),
    [
        ("dpo", "dpo.loss_type=kto", r"dpo.loss_type \('kto'\) must be one of \('sigmoid', 'robust', 'ipo', 'simpo'\)"),
        ("dpo", "dpo.beta=0", r"dpo.beta \(0.0\) must be > 0"),
        ("dpo", "dpo.label_smoothing=0.5", r"dpo.label_smoothing \(0.5\) must be in \[0, 0.5\)"),
        ("dpo", "dpo.rejected_key=chosen", r"dpo.chosen_key and dpo.rejected_key are both 'chosen'"),
        ("dpo", "ref.enable=false", r"ref.enable \(false\) with dpo.loss_type 'sigmoid'"),
        ("dpo", "actor.ppo_micro_batch_size_per_gpu=3", r"data.train_batch_size \(16 pairs x 2 = 32 sequences\)"),
        (
            "sft",
            "sft.loss_agg_mode=seq-mean-token-sum-norm",
            r"sft.loss_agg_mode \('seq-mean-token-sum-norm'\) must be",
        ),
        ("sft", "data.train_batch_size=30", r"must be divisible by actor.ppo_micro_batch_size_per_gpu \(16\)"),
    ],
)
def test_recipe_config_errors_name_the_key(recipe, override, message):
    import re

    assert re.search(message, _error(recipe, override))


def test_ipo_refuses_label_smoothing():
    assert "no meaning for dpo.loss_type 'ipo'" in _error("dpo", "dpo.loss_type=ipo", "dpo.label_smoothing=0.1")


def test_a_decaying_schedule_needs_steps_after_its_warmup():
    from hybridrl.config.checks_recipes import check_schedule

    cfg = load_recipe_config("sft", "tiny_cpu_sft.yaml", ["trainer.total_steps=5"])  # warmup 5, cosine
    expected = r"actor.optim.lr_warmup_steps \(5\) must be below the run's 5 optimizer updates \(trainer.total_steps 5"
    with pytest.raises(ConfigError, match=expected):
        check_schedule(cfg)
    check_schedule(load_recipe_config("sft", "tiny_cpu_sft.yaml", ["trainer.total_steps=6"]))
