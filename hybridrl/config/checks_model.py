"""Config checks against the model's shape: the layout sizes vs heads, KV groups, layers and context length
(:func:`check_architecture`, one of :data:`hybridrl.config.checks.CHECKS`), and ``model.architecture`` fields vs
a local checkpoint's ``config.json``. Split from :mod:`hybridrl.config.checks` (files stay under 600 lines);
its one-line error helpers are imported at call time (that module imports this one).
"""

from __future__ import annotations

import os
from typing import Any

from hybridrl.config.schema import RunConfig

SHAPE_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")  # fmt: skip
"""model.architecture fields that decide the weights' shapes: next to a checkpoint they must agree with it."""


def check_against_checkpoint(m: Any) -> None:
    """An architecture field next to a local checkpoint overrides its config.json (rope_theta, context length:
    fine); one that changes a weight's shape cannot load, e.g. a tiny config's block left in place."""
    from hybridrl.config.checks import _fail, _show

    config = os.path.join(m.path, "config.json") if m.path else None
    if not config or not os.path.isfile(config):
        return
    import json

    try:
        with open(config, encoding="utf-8") as f:
            ckpt = json.load(f)
    except (OSError, ValueError) as err:  # the memory estimate and the model builders read it too
        _fail(f"cannot read {config} ({type(err).__name__}: {err}); fix or re-save it (model.path)", "model.path")
    for name in SHAPE_FIELDS:
        mine, theirs = getattr(m.architecture, name), ckpt.get(name)
        if mine is not None and theirs is not None and mine != theirs:
            _fail(
                f"model.architecture.{name} ({_show(mine)}) differs from {name} ({_show(theirs)}) in model.path's "
                f"config.json: its weights have the checkpoint's shapes; set model.architecture.{name}=null (or drop "
                "the model.architecture block)",
                f"model.architecture.{name}",
            )


def check_architecture(cfg: RunConfig, world: int) -> None:
    """Heads, KV groups, layers and positions split over TP / PP, for the model as far as it is known before
    loading (:func:`hybridrl.config.memory.model_fields`: model.architecture, a local checkpoint's config.json,
    the public shape of a packaged config's model); a separate critic checkpoint too."""
    from hybridrl.config.checks import _fail
    from hybridrl.config.memory import model_fields

    fields = model_fields(cfg)
    if cfg.actor.share_prompt_prefix and fields.get("model_type") == "mistral" and fields.get("sliding_window"):
        _fail(f"actor.share_prompt_prefix (true) cannot pack a sliding-window model (sliding_window "
              f"{fields['sliding_window']}); set it to null (auto: row by row here) or false",
              "actor.share_prompt_prefix")  # fmt: skip
    _check_shape(cfg, fields, cfg.model.path, rollout=True)
    critic = cfg.critic.model_path
    if cfg.critic.enable and critic and critic != cfg.model.path:
        _check_shape(cfg, model_fields(cfg, critic), critic, rollout=False)


def _check_shape(cfg: RunConfig, fields: dict[str, Any], path: str | None, rollout: bool) -> None:
    from hybridrl.config.checks import _fail

    m, rtp = cfg.actor.megatron, cfg.rollout.tp_size
    given = {k for k, v in vars(cfg.model.architecture).items() if v is not None} if path == cfg.model.path else set()

    def name(field: str) -> str:  # the key a user edits, or where the value came from
        return f"model.architecture.{field}" if field in given or path is None else f"{field} of {path}"

    hidden, heads, head_dim = fields.get("hidden_size"), fields.get("num_attention_heads"), fields.get("head_dim")
    groups = fields.get("num_key_value_heads") or heads
    if hidden and heads and head_dim is None and hidden % heads:
        _fail(f"{name('hidden_size')} ({hidden}) must be divisible by num_attention_heads ({heads}), or set "
              "model.architecture.head_dim", name("hidden_size"))  # fmt: skip
    if heads and heads % m.tp_size:
        _fail(f"{name('num_attention_heads')} ({heads}) must be divisible by actor.megatron.tp_size ({m.tp_size}); "
              "choose a tp_size that divides it", "actor.megatron.tp_size")  # fmt: skip
    if heads and groups and heads % groups:
        _fail(f"{name('num_attention_heads')} ({heads}) must be divisible by num_key_value_heads ({groups})",
              name("num_key_value_heads"))  # fmt: skip
    if groups and groups % m.tp_size:
        _fail(f"{name('num_key_value_heads')} ({groups}) must be divisible by actor.megatron.tp_size ({m.tp_size}); "
              "choose a tp_size that divides it", "actor.megatron.tp_size")  # fmt: skip
    if rollout and heads and heads % rtp:
        _fail(f"{name('num_attention_heads')} ({heads}) must be divisible by rollout.tp_size ({rtp}); choose a "
              "rollout.tp_size that divides it", "rollout.tp_size")  # fmt: skip
    if rollout and groups and groups % rtp and rtp % groups:
        _fail(f"{name('num_key_value_heads')} ({groups}) and rollout.tp_size ({rtp}) must divide one another",
              "rollout.tp_size")  # fmt: skip
    positions, length = fields.get("max_position_embeddings"), cfg.rollout.max_model_len
    # with rope_scaling the usable context depends on the scaling type (vLLM's own check applies)
    if rollout and positions and positions < length and not fields.get("rope_scaling"):
        _fail(f"{name('max_position_embeddings')} ({positions}) must be >= rollout.max_model_len ({length}); lower "
              "data.max_prompt_length + data.max_response_length (or, if the checkpoint takes longer inputs, set "
              "model.architecture.max_position_embeddings)", "rollout.max_model_len")  # fmt: skip
    stages, layers = m.pp_size * m.vpp_size, fields.get("num_hidden_layers")
    if layers and layers % stages:
        _fail(
            f"{name('num_hidden_layers')} ({layers}) must be divisible by actor.megatron.pp_size ({m.pp_size}) * "
            f"vpp_size ({m.vpp_size}) = {stages}; choose sizes that divide it",
            "actor.megatron.pp_size",
        )
