"""Typed run config: dataclasses own the defaults, YAML and ``key=value`` overrides only set fields.

    from hybridrl.config import load_config
    cfg = load_config("ppo_llama2_7b.yaml", ["actor.megatron.tp_size=4"])
    cfg.actor.megatron.dp_size          # derived: world / (tp * pp * cp)

- :mod:`~hybridrl.config.schema` / :mod:`~hybridrl.config.schema_roles`: the dataclasses (one docstring
  per field);
- :mod:`~hybridrl.config.loader`: finding, merging (OmegaConf), key and type errors, :func:`to_yaml`;
- :mod:`~hybridrl.config.checks`: derived fields and cross-field checks (batch sizes, roles, ...);
- :mod:`~hybridrl.config.layout`: :func:`run_layout`, the run's :class:`~hybridrl.distributed.ParallelLayout`
  (training and generation groups) from ``actor.megatron``'s layout keys and ``rollout.tp_size``, and its checks.

Every failure is a :class:`ConfigError` (a ``ValueError``) with one line naming the key, value and fix.
"""

from hybridrl.config.checks import fill_derived, validate
from hybridrl.config.layout import run_layout, world_size_of
from hybridrl.config.loader import ALIASES, available_configs, compose_config, find_config, load_config, to_yaml
from hybridrl.config.schema import (
    AlgorithmConfig,
    ArchitectureConfig,
    ConfigError,
    CustomRewardConfig,
    DataConfig,
    KLControlConfig,
    ModelConfig,
    ResourcesConfig,
    RewardConfig,
    RewardModelConfig,
    RunConfig,
    TrainerConfig,
)
from hybridrl.config.schema_roles import (
    ActorConfig,
    CriticConfig,
    MegatronConfig,
    MegatronLayoutConfig,
    MegatronOptionsConfig,
    OptimConfig,
    RefConfig,
    RolloutConfig,
    RolloutValConfig,
)

__all__ = [
    "ALIASES",
    "ActorConfig",
    "AlgorithmConfig",
    "ArchitectureConfig",
    "ConfigError",
    "CriticConfig",
    "CustomRewardConfig",
    "DataConfig",
    "KLControlConfig",
    "MegatronConfig",
    "MegatronLayoutConfig",
    "MegatronOptionsConfig",
    "ModelConfig",
    "OptimConfig",
    "RefConfig",
    "ResourcesConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "RolloutValConfig",
    "RunConfig",
    "TrainerConfig",
    "available_configs",
    "compose_config",
    "fill_derived",
    "find_config",
    "load_config",
    "run_layout",
    "to_yaml",
    "validate",
    "world_size_of",
]
