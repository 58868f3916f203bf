"""Config checks of MoE routing replay (``actor.moe``), before any model or engine is built.

:func:`check_routing` (one of :data:`hybridrl.config.checks.CHECKS`) refuses ``actor.moe.routing_replay`` where
the recorded routes could not exist or could not be followed, in one line naming the key and the fix: a dense
model (no routers), a rollout that cannot record routes (the multi-turn agent loop drives vLLM turn by turn and
records none; a rollout backend other than vLLM), packed prompt sharing (routes follow rows) and activation
recompute (a recomputed forward would need its micro-batch's routes again, in backward order).
:func:`records_routes` is what the actor worker asks: does this run record the rollout's routes at all.
"""

from __future__ import annotations

from hybridrl.config.checks_agent import agent_enabled
from hybridrl.config.checks_moe import MOE_MODEL_TYPES, moe_fields
from hybridrl.config.schema import RunConfig
from hybridrl.config.schema_roles import ActorConfig, RolloutConfig


def records_routes(actor: ActorConfig, rollout: RolloutConfig, is_moe: bool) -> bool:
    """The rollout records the experts of each token: an MoE policy, single-turn vLLM generation and the metric or
    replay on (``actor.moe``)."""
    agent = rollout.agent.env is not None or rollout.agent.path is not None
    return is_moe and (actor.moe.routing_metric or actor.moe.routing_replay) and rollout.backend == "vllm" and not agent


def check_routing(cfg: RunConfig, world: int) -> None:
    """``actor.moe.routing_replay`` against the model and the rollout (see the module docs)."""
    from hybridrl.config.checks import _fail
    from hybridrl.config.memory import model_fields

    if not cfg.actor.moe.routing_replay:
        return
    key = "actor.moe.routing_replay"
    fields = model_fields(cfg)
    if moe_fields(fields) is None and (fields.get("model_type") or fields.get("hidden_size")):  # unknown: at load
        _fail(f"{key} (true) needs a mixture-of-experts model (model_type {', '.join(MOE_MODEL_TYPES)}), and "
              f"{fields.get('model_type') or 'this model'} is dense; set {key}=false", key)  # fmt: skip
    if cfg.rollout.backend != "vllm":
        _fail(f"{key} (true) needs routes recorded by the vLLM rollout, and rollout.backend is "
              f"{cfg.rollout.backend!r}; set rollout.backend=vllm or {key}=false", key)  # fmt: skip
    if agent_enabled(cfg):
        _fail(f"{key} (true) needs routes from single-turn generation; the agent loop (rollout.agent.env="
              f"{cfg.rollout.agent.env!r}) records none; unset rollout.agent or set {key}=false", key)  # fmt: skip
    if cfg.actor.share_prompt_prefix:
        _fail(f"{key} (true) replays routes row by row, and actor.share_prompt_prefix (true) packs rows; set "
              "actor.share_prompt_prefix=false (or leave it unset)", key)  # fmt: skip
    recompute = cfg.actor.megatron.recompute_granularity
    if recompute is not None:
        _fail(f"{key} (true) cannot replay routes in recomputed forwards (actor.megatron.recompute_granularity "
              f"{recompute!r}); set actor.megatron.recompute_granularity=null or {key}=false", key)  # fmt: skip
