"""The run's parallel layout from its config: the one place config fields become a
:class:`~hybridrl.distributed.layout.ParallelLayout`, and the layout's config checks.

:func:`run_layout` reads the layout keys (``actor.megatron``'s tp/pp/dp/vpp/cp/ep sizes, the only home of these keys)
and ``rollout.tp_size`` (the generation side) with the launched world size. The config checks, ``hybridrl
validate-config``'s report and the run (``hybridrl.trainer.main``, which passes the object down to Megatron's
groups, the workers, the hybrid engine and the vLLM engines) all get their layout from it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hybridrl.config.schema import ConfigError, RunConfig
from hybridrl.config.schema_roles import MegatronConfig, MegatronLayoutConfig, MegatronOptionsConfig
from hybridrl.distributed.layout import LayoutError, ParallelLayout

LAYOUT_KEYS = tuple(f.name for f in dataclasses.fields(MegatronLayoutConfig))
"""The layout keys: set in ``actor.megatron`` only (``ref.megatron`` / ``critic.megatron`` hold options)."""
OPTION_KEYS = tuple(f.name for f in dataclasses.fields(MegatronOptionsConfig))


def world_size_of(cfg: RunConfig, world_size: int | None = None) -> int:
    """The launch's world size, or ``trainer.nnodes * trainer.n_gpus_per_node``."""
    return world_size if world_size is not None else cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node


def run_layout(cfg: RunConfig, world_size: int | None = None) -> ParallelLayout:
    """The run's training and generation layout over ``world_size`` ranks (None: the config's nodes x processes).

    Raises:
        ConfigError: a layout that cannot be built, prefixed with the key at fault (``actor.megatron`` or
            ``rollout.tp_size``).
    """
    m = cfg.actor.megatron
    try:
        return ParallelLayout.from_world(
            world_size_of(cfg, world_size), tp=m.tp_size, pp=m.pp_size, cp=m.cp_size, ep=m.ep_size,
            vpp=m.vpp_size, dp=m.dp_size, rollout_tp=cfg.rollout.tp_size,
        )  # fmt: skip
    except LayoutError as exc:
        key = "rollout.tp_size" if exc.axis == "rollout_tp" else "actor.megatron"
        raise ConfigError(f"{key}: {exc}", key=key) from None


def derived_dp(megatron: MegatronLayoutConfig, world: int) -> int | None:
    """``dp_size`` as the layout derives it (world / (tp * pp * cp)); None when the sizes do not fit the world (the
    checks then say why)."""
    try:
        return ParallelLayout.from_world(world, tp=megatron.tp_size, pp=megatron.pp_size, cp=megatron.cp_size).dp
    except LayoutError:
        return None


def options_of(megatron: MegatronConfig) -> MegatronOptionsConfig:
    """The options part of ``actor.megatron`` (what ``ref.megatron`` / ``critic.megatron`` start from)."""
    return MegatronOptionsConfig(**{name: getattr(megatron, name) for name in OPTION_KEYS})


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else repr(value)


def _fail(message: str, key: str) -> None:
    raise ConfigError(message, key=key)


def check_layouts(cfg: RunConfig, world: int) -> None:
    """The layout fits the world (training and generation), tensor-parallel groups stay inside a node, and each
    enabled role's Megatron options are consistent."""
    layout = run_layout(cfg, world)
    t, m = cfg.trainer, cfg.actor.megatron
    for key, tp in (("actor.megatron.tp_size", layout.tp), ("rollout.tp_size", layout.rollout_tp)):
        if t.nnodes > 1 and t.n_gpus_per_node % tp:  # TP groups are consecutive ranks: keep them on one node
            _fail(f"{key} ({tp}) must divide trainer.n_gpus_per_node ({t.n_gpus_per_node}): a tensor-parallel group "
                  f"must not span nodes; lower {key}", key)  # fmt: skip
    for name, what in (("cp_size", "context parallelism"), ("ep_size", "expert parallelism (MoE)")):
        if getattr(m, name) != 1:
            _fail(f"actor.megatron.{name} ({getattr(m, name)}) must be 1: {what} is not supported yet (dense "
                  f"Llama/Qwen models only); set actor.megatron.{name}=1", f"actor.megatron.{name}")  # fmt: skip
    roles = ["actor"] + [r for r in ("ref", "critic") if getattr(cfg, r).enable]
    for role in roles:
        _check_options(cfg, f"{role}.megatron", getattr(cfg, role).megatron, layout.tp)


def _check_options(cfg: RunConfig, key: str, m: MegatronOptionsConfig, tp: int) -> None:
    if m.sequence_parallel and tp == 1:
        _fail(f"{key}.sequence_parallel (true) needs tp_size > 1 (got 1); set {key}.sequence_parallel=false",
              f"{key}.sequence_parallel")  # fmt: skip
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length  # every batch's width (prompts left-padded)
    if m.sequence_parallel and seq % tp:
        _fail(f"{key}.sequence_parallel (true) splits each sequence over tp_size ({tp}), and "
              f"data.max_prompt_length + data.max_response_length = {seq} is not divisible by it; change "
              "data.max_prompt_length", "data.max_prompt_length")  # fmt: skip
    full = m.recompute_granularity == "full"
    if full and (m.recompute_method is None or m.recompute_num_layers is None):
        _fail(f"{key}.recompute_granularity ('full') needs recompute_method and recompute_num_layers "
              f"(got {_show(m.recompute_method)}, {_show(m.recompute_num_layers)}); e.g. uniform and 1",
              f"{key}.recompute_method")  # fmt: skip
    if not full and (m.recompute_method is not None or m.recompute_num_layers is not None):
        _fail(f"{key}.recompute_method ({_show(m.recompute_method)}) / recompute_num_layers "
              f"({_show(m.recompute_num_layers)}) need recompute_granularity 'full' "
              f"(got {_show(m.recompute_granularity)}); set them to null", f"{key}.recompute_method")  # fmt: skip
    if m.recompute_num_layers is not None and m.recompute_num_layers < 1:
        _fail(f"{key}.recompute_num_layers ({m.recompute_num_layers}) must be positive", key)


def moved_key_message(role: str, key: str, value: Any, actors: Any, source: str = "") -> tuple[bool, str]:
    """(is it an error, the one line) for a layout key given under ``ref.megatron`` / ``critic.megatron``: the
    layout is ``actor.megatron``'s alone, so a value equal to the actor's (or null) is ignored with a note, and
    one that differs is a :class:`ConfigError` naming both."""
    if value is not None and value != actors:
        return True, (
            f"{role}.megatron.{key} ({_show(value)}) must equal actor.megatron.{key} ({_show(actors)}): all roles "
            f"share the actor's process groups; remove {role}.megatron.{key}{source}"
        )
    return False, (
        f"note: {role}.megatron.{key} ({_show(value)}){source} is ignored: the layout keys moved to actor.megatron, "
        f"which every role shares; remove it"
    )
