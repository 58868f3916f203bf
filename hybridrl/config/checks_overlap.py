"""Where ``reward.overlap_generation`` (scoring responses while the batch still generates) applies.

The streaming scorer (:mod:`hybridrl.rewards.stream`) hands each response vLLM finishes (with ``rollout.agent``:
each trajectory the moment its episode ends) to the rule-based / custom scorer at once, on the ranks (SPMD) or
host actors (``trainer.launcher=ray``) that generate them. It needs a rule-based scorer (``reward.scorer`` not
None; a reward model scores whole batches).
"""

from __future__ import annotations

from hybridrl.config.schema import ConfigError, RunConfig


def overlap_blockers(cfg: RunConfig) -> list[str]:
    """Why ``reward.overlap_generation`` cannot apply to this run (empty: it can)."""
    out = []
    if cfg.reward.scorer is None:
        out.append("reward.scorer is null (no rule-based scorer to run)")
    return out


def overlap_enabled(cfg: RunConfig) -> bool:
    """``reward.overlap_generation`` resolved: None = wherever it applies."""
    return cfg.reward.overlap_generation is not False and not overlap_blockers(cfg)


def check_overlap(cfg: RunConfig, world: int) -> None:
    """``reward.overlap_generation=true`` only where it applies."""
    blockers = overlap_blockers(cfg)
    if cfg.reward.overlap_generation and blockers:
        raise ConfigError(
            f"reward.overlap_generation (true) does not apply here: {blockers[0]}; set it to null (auto) or false",
            key="reward.overlap_generation",
        )
