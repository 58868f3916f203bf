"""RL algorithms as pure functions on masked ``(batch, response_len)`` tensors, with registries.

- :mod:`~hybridrl.algos.advantages`: advantage estimators (gae, grpo, rloo, reinforce++, remax), each declaring
  the inputs it needs; :mod:`~hybridrl.algos.group_estimators`: gpg and pass@k;
- :mod:`~hybridrl.algos.losses`: the policy-loss registry (PPO clip), clipped value loss, entropy bonus;
  :mod:`~hybridrl.algos.policy_variants`: gspo, cispo, gpg, clip_cov, kl_cov;
- :mod:`~hybridrl.algos.rollout_correction`: TIS weights and MIS masks from the rollout engine's log-probs;
- :mod:`~hybridrl.algos.dynamic_sampling`: DAPO's group filter and soft overlong punishment;
- :mod:`~hybridrl.algos.kl`: KL estimators (straight-through variants included), KL reward penalty and KL loss,
  KL coefficient controllers;
- :mod:`~hybridrl.algos.aggregation`: the loss aggregation modes (the one home of their formulas);
- :mod:`~hybridrl.algos.objectives`: the actor's and the critic's losses, composed from the above;
- :mod:`~hybridrl.algos.masked`: masked mean / variance / whitening.
"""

from hybridrl.algos.advantages import (
    ADV_ESTIMATORS,
    compute_advantages,
    get_adv_estimator,
    register_adv_estimator,
)
from hybridrl.algos.aggregation import AGG_MODES, agg_loss
from hybridrl.algos.dynamic_sampling import informative_rows, overlong_penalty
from hybridrl.algos.group_estimators import gpg, pass_at_k
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
    POLICY_LOSSES,
    entropy_bonus,
    get_policy_loss,
    ppo_clip_loss,
    register_policy_loss,
    value_loss,
)
from hybridrl.algos.objectives import ActorLoss, CriticLoss
from hybridrl.algos.policy_variants import cispo_loss, clip_cov_loss, gpg_loss, gspo_loss, kl_cov_loss
from hybridrl.algos.rollout_correction import rollout_correction

__all__ = [
    "ADV_ESTIMATORS",
    "AGG_MODES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "ActorLoss",
    "AdaptiveKLController",
    "CriticLoss",
    "FixedKLController",
    "agg_loss",
    "apply_kl_penalty",
    "cispo_loss",
    "clip_cov_loss",
    "compute_advantages",
    "entropy_bonus",
    "get_adv_estimator",
    "get_kl_estimator",
    "get_policy_loss",
    "gpg",
    "gpg_loss",
    "gspo_loss",
    "informative_rows",
    "kl_cov_loss",
    "kl_loss",
    "kl_penalty",
    "make_kl_controller",
    "overlong_penalty",
    "pass_at_k",
    "ppo_clip_loss",
    "register_adv_estimator",
    "register_policy_loss",
    "rollout_correction",
    "value_loss",
]
