"""Config checks of the FSDP backend (``critic.backend: fsdp``, ``ref.backend: fsdp``), run before any model is
built (:func:`check_fsdp_roles`, one of :data:`hybridrl.config.checks.CHECKS`).

What the backend cannot serve gets one line naming the key, the value and the fix:

- a model that transformers has no causal-LM class for (the backend builds the HF model itself; Megatron's
  bridge has its own list of families, checked elsewhere), as far as its type is known before loading
  (``model.architecture``, a local folder's config.json; a Hub name not downloaded yet is checked when read);
- ``critic.optim.backend: megatron``: that path is Megatron's optimizer, which an FSDP critic does not have;
- a critic mini-batch that does not split over every rank: an FSDP role is data-parallel over the whole world
  (each rank holds ``1 / world`` of the model and computes on ``1 / world`` of the batch), not over
  ``actor.megatron.dp_size``.
"""

from __future__ import annotations

from typing import Any

from hybridrl.config.schema import RunConfig

FSDP = "fsdp"


def _causal_lm_types() -> set[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _check_model(role: str, fields: dict[str, Any], path: str | None) -> None:
    from hybridrl.config.checks import _fail

    model_type = fields.get("model_type")
    if model_type is None:  # a Hub name not downloaded yet: known once the folder is read (transformers checks it)
        return
    where = f"{path}'s config.json" if path else "model.architecture"
    if model_type not in _causal_lm_types():
        _fail(f"{role}.backend ({FSDP!r}) cannot serve model_type {model_type!r} ({where}): transformers has no causal "
              f"LM class for it; set {role}.backend=megatron", f"{role}.backend")  # fmt: skip


def _check_critic_batches(cfg: RunConfig, world: int) -> None:
    from hybridrl.config.checks import _fail

    c, n = cfg.critic, cfg.rollout.n
    responses = c.ppo_mini_batch_size * n
    if responses % (c.ppo_micro_batch_size_per_gpu * world):
        _fail(
            f"critic.ppo_mini_batch_size ({c.ppo_mini_batch_size}) * rollout.n ({n}) = {responses} responses must be "
            f"divisible by critic.ppo_micro_batch_size_per_gpu ({c.ppo_micro_batch_size_per_gpu}) * world_size "
            f"({world}): critic.backend 'fsdp' splits every update over all ranks; lower "
            "critic.ppo_micro_batch_size_per_gpu or raise critic.ppo_mini_batch_size",
            "critic.ppo_mini_batch_size",
        )


def check_fsdp_roles(cfg: RunConfig, world: int) -> None:
    """The enabled roles on ``fsdp`` can be served (module docs)."""
    from hybridrl.config.checks import _fail
    from hybridrl.config.memory import model_fields

    if cfg.ref.enable and cfg.ref.backend == FSDP:
        _check_model("ref", model_fields(cfg), cfg.model.path)
    if not (cfg.critic.enable and cfg.critic.backend == FSDP):
        return
    path = cfg.critic.model_path
    _check_model("critic", model_fields(cfg, path), path)
    if cfg.critic.optim.backend == "megatron":
        _fail("critic.optim.backend ('megatron') is Megatron's optimizer, and critic.backend is 'fsdp' (AdamW on the "
              "FSDP shards); set critic.optim.backend=auto", "critic.optim.backend")  # fmt: skip
    _check_critic_batches(cfg, world)
