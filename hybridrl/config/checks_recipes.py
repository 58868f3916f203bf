"""Loading and checking the config of an offline recipe (``hybridrl sft`` / ``hybridrl dpo``).

A recipe reads the run config's ``model``, ``actor`` (layout, Megatron options, optimizer, micro-batch size),
``ref`` (DPO), ``data`` and ``trainer`` sections and its own (``sft`` / ``dpo``,
:mod:`hybridrl.config.schema_recipes`). :func:`load_recipe_config` composes the config as :func:`load_config` does,
turns off what the recipe does not build (the critic; the reference except for DPO with a reference), fills the
derived fields, and runs the checks that concern what the recipe builds: the shared ones of
:data:`RECIPE_CHECKS` (choices, counts, optimizer, model and data sources, world, layout, architecture) and its
own (:func:`check_recipe`: batch sizes in sequences, the ``sft`` / ``dpo`` fields). The rollout and the RL loss
are not built, so their checks do not run.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridrl.config.checks import (
    _fail,
    check_architecture,
    check_choices,
    check_counts,
    check_layouts,
    check_optim,
    check_optim_backend,
    check_sources,
    check_world,
    fill_derived,
)
from hybridrl.config.checks_moe import check_moe
from hybridrl.config.layout import world_size_of
from hybridrl.config.loader import compose_config
from hybridrl.config.schema import RunConfig
from hybridrl.config.schema_recipes import DPO_LOSSES, REFERENCE_FREE_LOSSES
from hybridrl.config.schema_roles import LOSS_AGG_MODES

RECIPES = ("sft", "dpo")
RECIPE_CHECKS = (check_choices, check_counts, check_optim, check_sources, check_world, check_layouts,
                 check_optim_backend, check_architecture, check_moe)  # fmt: skip
"""The shared checks that apply to an offline recipe, in :data:`hybridrl.config.checks.CHECKS` order."""


def sequences_per_step(cfg: RunConfig, recipe: str) -> int:
    """Sequences of one optimizer step over all DP ranks: the examples (SFT) or twice the pairs (DPO)."""
    return cfg.data.train_batch_size * (2 if recipe == "dpo" else 1)


def check_recipe(cfg: RunConfig, recipe: str) -> None:
    """The recipe's own rules: its batch splits into whole micro-batches on every DP rank, its section's values."""
    m, micro = cfg.actor.megatron, cfg.actor.ppo_micro_batch_size_per_gpu
    rows, what = sequences_per_step(cfg, recipe), "pairs x 2" if recipe == "dpo" else "examples"
    if rows % (micro * m.dp_size):
        _fail(f"data.train_batch_size ({cfg.data.train_batch_size} {what} = {rows} sequences) must be divisible by "
              f"actor.ppo_micro_batch_size_per_gpu ({micro}) * actor.megatron.dp_size ({m.dp_size}); change "
              "data.train_batch_size or the micro-batch size", "data.train_batch_size")  # fmt: skip
    count = rows // (micro * m.dp_size)
    if m.vpp_size > 1 and count % m.pp_size:
        _fail(
            f"{count} micro-batches per step must be a multiple of actor.megatron.pp_size ({m.pp_size}) with "
            f"vpp_size {m.vpp_size}; lower actor.ppo_micro_batch_size_per_gpu",
            "actor.ppo_micro_batch_size_per_gpu",
        )
    for key, bad, why in (
        ("actor.lora.enable", cfg.actor.lora.enable, "the recipes train every weight (LoRA is for RL runs for now)"),
        ("ref.backend", recipe == "dpo" and cfg.ref.backend != "megatron", "the DPO reference runs on Megatron"),
    ):
        if bad:
            value = "true" if key == "actor.lora.enable" else repr(cfg.ref.backend)
            default = "false" if key == "actor.lora.enable" else "megatron"
            _fail(f"{key} ({value}) is not supported by hybridrl {recipe}: {why}; set {key}={default}", key)
    if recipe == "sft" and cfg.sft.loss_agg_mode not in LOSS_AGG_MODES[:4]:
        _fail(f"sft.loss_agg_mode ({cfg.sft.loss_agg_mode!r}) must be one of {LOSS_AGG_MODES[:4]}",
              "sft.loss_agg_mode")  # fmt: skip
    if recipe == "dpo":
        _check_dpo(cfg)


def check_schedule(cfg: RunConfig, updates: dict[str, int] | None = None) -> None:
    """Once ``trainer.total_steps`` is known (the dataset read): a decaying LR schedule has updates after its warmup.

    Args:
        cfg: the filled-in config.
        updates: optimizer updates over the run per role ("actor" / "critic"); None = the recipes' one update per
            trainer step for the actor.
    """
    for role, total in (updates or {"actor": cfg.trainer.total_steps}).items():
        o = getattr(cfg, role).optim
        warmup = o.lr_warmup_steps if o.lr_warmup_steps is not None else int(o.lr_warmup_ratio * total)
        if o.lr_decay_style != "constant" and warmup >= total:
            _fail(f"{role}.optim.lr_warmup_steps ({warmup}) must be below the run's {total} optimizer updates "
                  f"(trainer.total_steps {cfg.trainer.total_steps}) with {role}.optim.lr_decay_style "
                  f"{o.lr_decay_style!r}; lower it, raise trainer.total_steps or set lr_decay_style=constant",
                  f"{role}.optim.lr_warmup_steps")  # fmt: skip


def _check_dpo(cfg: RunConfig) -> None:
    d = cfg.dpo
    if d.loss_type not in DPO_LOSSES:
        _fail(f"dpo.loss_type ({d.loss_type!r}) must be one of {DPO_LOSSES}", "dpo.loss_type")
    if d.beta <= 0:
        _fail(f"dpo.beta ({d.beta}) must be > 0 (e.g. 0.1)", "dpo.beta")
    if not 0 <= d.label_smoothing < 0.5:
        _fail(f"dpo.label_smoothing ({d.label_smoothing}) must be in [0, 0.5): the probability that a label is "
              "flipped (0 = plain DPO)", "dpo.label_smoothing")  # fmt: skip
    if d.label_smoothing and d.loss_type == "ipo":
        _fail(f"dpo.label_smoothing ({d.label_smoothing}) has no meaning for dpo.loss_type 'ipo'; set it to 0 or use "
              "loss_type sigmoid / robust", "dpo.label_smoothing")  # fmt: skip
    if d.simpo_gamma < 0:
        _fail(f"dpo.simpo_gamma ({d.simpo_gamma}) must be >= 0", "dpo.simpo_gamma")
    if d.chosen_key == d.rejected_key:
        _fail(f"dpo.chosen_key and dpo.rejected_key are both {d.chosen_key!r}; name two columns", "dpo.rejected_key")
    if cfg.ref.enable is False and d.loss_type not in REFERENCE_FREE_LOSSES:
        _fail(f"ref.enable (false) with dpo.loss_type {d.loss_type!r}: its reward is a log-ratio to the reference; set "
              "ref.enable=null or a reference-free loss_type (simpo)", "ref.enable")  # fmt: skip


def load_recipe_config(
    recipe: str, name_or_path: str | None = None, overrides: Sequence[str] = (), world_size: int | None = None
) -> RunConfig:
    """Load, complete and check the config of ``recipe`` ("sft" / "dpo") (module docs).

    Raises:
        ConfigError: one line naming the key, the value and the fix.
    """
    if recipe not in RECIPES:
        raise ValueError(f"recipe ({recipe!r}) must be one of {RECIPES}")
    cfg = compose_config(name_or_path, overrides, world_size)
    if recipe == "dpo":
        _check_dpo(cfg)  # before ref.enable is derived from it
    cfg.critic.enable = False
    if cfg.ref.enable is None:
        cfg.ref.enable = recipe == "dpo" and cfg.dpo.loss_type not in REFERENCE_FREE_LOSSES
    fill_derived(cfg, world_size)
    world = world_size_of(cfg, world_size)
    for check in RECIPE_CHECKS:
        check(cfg, world)
    check_recipe(cfg, recipe)
    return cfg
