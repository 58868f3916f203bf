"""Config sections of the offline recipes: ``sft`` (supervised fine-tuning) and ``dpo`` (preference pairs).

Both recipes run on the run config's other sections: the policy is ``model`` + ``actor`` (its Megatron layout,
options and optimizer), the data files and lengths are ``data``, the loop, checkpoints and loggers ``trainer``;
the DPO reference is ``ref``. What only a recipe has lives here. ``hybridrl sft CONFIG`` / ``hybridrl dpo CONFIG``
choose the recipe (:mod:`hybridrl.trainer.offline`); a PPO run ignores these sections.

Batch sizes: ``data.train_batch_size`` is the examples (SFT) or pairs (DPO) of one optimizer step over all DP
ranks, and ``actor.ppo_micro_batch_size_per_gpu`` the sequences of one forward/backward micro-batch on a DP rank
(a DPO pair is two sequences).
"""

from __future__ import annotations

from dataclasses import dataclass

DPO_LOSSES = ("sigmoid", "robust", "ipo", "simpo")
"""``dpo.loss_type`` names (TRL's): their formulas live in :mod:`hybridrl.algos.preference`."""
REFERENCE_FREE_LOSSES = ("simpo",)
"""DPO losses that read no reference log-probs (no reference model is built for them)."""


@dataclass
class SFTConfig:
    """Supervised fine-tuning on chat data: next-token loss on the assistant tokens only."""

    messages_key: str = "messages"
    """Column of chat rows: a list of ``{"role", "content"}`` messages, rendered with the tokenizer's chat template;
    every assistant turn is trained on. Files without it need ``data.prompt_key`` and ``response_key`` instead."""
    response_key: str = "response"
    """Column of the response text in ``prompt`` + ``response`` rows (the prompt is ``data.prompt_key``: chat
    messages or a string, rendered as the RL prompts are)."""
    loss_agg_mode: str = "token-mean"
    """How the per-token losses of a step become one number (actor.loss_agg_mode's names): "token-mean" weighs
    every assistant token of the step equally."""


@dataclass
class DPOConfig:
    """Direct preference optimisation on ``prompt``, ``chosen``, ``rejected`` rows."""

    chosen_key: str = "chosen"
    """Column of the preferred response (a string, or chat messages whose assistant turn is the response)."""
    rejected_key: str = "rejected"
    """Column of the dispreferred response (as chosen_key)."""
    loss_type: str = "sigmoid"
    """"sigmoid" (DPO, Rafailov et al. 2023), "robust" (robust DPO, Chowdhury et al. 2024), "ipo" (Azar et al.
    2023) or "simpo" (reference-free, Meng et al. 2024); formulas in :mod:`hybridrl.algos.preference`."""
    beta: float = 0.1
    """Inverse temperature of the implicit reward ``beta * log(pi / pi_ref)`` (IPO: its regulariser tau), > 0."""
    label_smoothing: float = 0.0
    """Probability that a pair's preference label is flipped (conservative DPO, Mitchell 2023; robust DPO's
    epsilon, Chowdhury et al. 2024), in [0, 0.5); read by "sigmoid", "robust" and "simpo", not "ipo"."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin gamma (eq. 6 of the paper), >= 0; "simpo" only."""
