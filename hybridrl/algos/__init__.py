"""RL algorithms as pure functions on masked ``(batch, response_len)`` tensors, with registries.

- :mod:`~hybridrl.algos.advantages`: advantage estimators (gae, grpo, rloo, reinforce++, remax);
- :mod:`~hybridrl.algos.losses`: PPO clip policy loss (registry), clipped value loss, entropy bonus,
  loss aggregation modes;
- :mod:`~hybridrl.algos.kl`: KL estimators, KL reward penalty and KL loss, KL coefficient controllers;
- :mod:`~hybridrl.algos.masked`: masked mean / variance / whitening.
"""

from hybridrl.algos.advantages import (
    ADV_ESTIMATORS,
    compute_advantages,
    get_adv_estimator,
    register_adv_estimator,
)
from hybridrl.algos.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    get_kl_estimator,
    kl_loss,
    kl_penalty,
    make_kl_controller,
)
from hybridrl.algos.losses import (
    AGG_MODES,
    POLICY_LOSSES,
    agg_loss,
    entropy_bonus,
    get_policy_loss,
    ppo_clip_loss,
    register_policy_loss,
    value_loss,
)

__all__ = [
    "ADV_ESTIMATORS",
    "AGG_MODES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "apply_kl_penalty",
    "compute_advantages",
    "entropy_bonus",
    "get_adv_estimator",
    "get_kl_estimator",
    "get_policy_loss",
    "kl_loss",
    "kl_penalty",
    "make_kl_controller",
    "ppo_clip_loss",
    "register_adv_estimator",
    "register_policy_loss",
    "value_loss",
]
