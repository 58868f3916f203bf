"""Config checks of ``actor.lora`` (:func:`check_lora`, one of :data:`hybridrl.config.checks.CHECKS`): its own
fields, and the settings LoRA cannot run with, each a one-line error naming the key and the fix before any model
is built. Split from :mod:`hybridrl.config.checks` (files stay under 600 lines); its error helpers are imported
at call time (that module imports this one).
"""

from __future__ import annotations

import difflib
import math

from hybridrl.config.schema import RunConfig
from hybridrl.config.schema_roles import LORA_TARGETS


def check_lora(cfg: RunConfig, world: int) -> None:
    """``actor.lora``: rank >= 1, alpha > 0, dropout in [0, 1), known target modules; and no setting it cannot
    support: sequence parallelism (the adapters' input would be a sequence slice), a reference on another
    backend or offloaded (with LoRA the reference IS the actor's frozen weights), the actor's param_offload (the
    merged push and the parked weights would be different tensors)."""
    from hybridrl.config.checks import _fail, _show

    c = cfg.actor.lora
    if not c.enable:
        return
    if c.rank < 1:
        _fail(f"actor.lora.rank ({c.rank}) must be >= 1; set e.g. actor.lora.rank=8", "actor.lora.rank")
    if not (math.isfinite(c.alpha) and c.alpha > 0):
        _fail(f"actor.lora.alpha ({c.alpha!r}) must be > 0; e.g. twice the rank", "actor.lora.alpha")
    if not 0.0 <= c.dropout < 1.0:
        _fail(f"actor.lora.dropout ({c.dropout!r}) must be in [0, 1); e.g. 0.05", "actor.lora.dropout")
    if not c.target_modules:
        _fail("actor.lora.target_modules ([]) names no layer; e.g. [all-linear] or [q_proj, v_proj]",
              "actor.lora.target_modules")  # fmt: skip
    for name in c.target_modules:
        if name not in LORA_TARGETS:
            close = difflib.get_close_matches(str(name), LORA_TARGETS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            _fail(f"actor.lora.target_modules: {name!r} matches no layer; {hint}choose from {list(LORA_TARGETS)}",
                  "actor.lora.target_modules")  # fmt: skip
    unsupported = (
        ("actor.megatron.sequence_parallel", cfg.actor.megatron.sequence_parallel, "false"),
        ("actor.param_offload", cfg.actor.param_offload, "false"),
        ("ref.param_offload", cfg.ref.enable and cfg.ref.param_offload,
         "false (the reference has no weights of its own)"),
    )  # fmt: skip
    for key, bad, fix in unsupported:
        if bad:
            _fail(f"{key} (true) cannot run with actor.lora.enable (true); set {key}={fix}", key)
    from hybridrl.config.checks_moe import moe_fields
    from hybridrl.config.memory import model_fields

    if moe_fields(model_fields(cfg)) is not None:  # adapters on experts would need expert-parallel grads and names
        _fail("actor.lora.enable (true) cannot adapt a mixture-of-experts model yet (its expert linears would get "
              "data-parallel gradients and one PEFT name for all experts); set actor.lora.enable=false",
              "actor.lora.enable")  # fmt: skip
    if cfg.ref.enable and cfg.ref.backend != "megatron":
        _fail(f"ref.backend ({_show(cfg.ref.backend)}) cannot run with actor.lora.enable (true): the reference is the "
              "actor with its adapters off; set ref.backend=megatron", "ref.backend")  # fmt: skip
