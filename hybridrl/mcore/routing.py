"""Routing agreement between rollout and training for MoE policies: the mismatch metric and routing replay.

The rollout engine records, per token and MoE layer, the top-k experts it routed the token to
(``ROUTES_KEY`` in the batch, ``(b, s, layers, k)`` int, aligned with ``input_ids``, ``-1`` where unknown: padding,
and each response's last token, which generation never feeds back through the model). This module owns what the
Megatron training forward does with them (docs/moe_routing.md):

- **metric**: per training pass over a batch, with ``P`` the set of (token, MoE layer) pairs where the token is a
  response token (``response_mask`` 1) and a rollout route is known,

      moe/routing_mismatch        = #{(t, l) in P : E_train(t, l) != E_rollout(t, l)} / |P|
      moe/routing_mismatch_router = #{(t, l) in P : topk_router(t, l) != E_rollout(t, l)} / |P|

  where ``E`` are expert SETS (order ignored), ``E_train`` the experts the training forward used and
  ``topk_router`` the experts the training router picks by itself. Counts are summed over micro-batches,
  pipeline stages (each holds its layers) and data-parallel ranks before the division. Without replay both are
  equal; with replay the first is 0 where routes are replayed and the second still measures the disagreement.
- **replay** (``actor.moe.routing_replay``): each token goes to the recorded experts; the gate weights are still
  the training router's, for those experts (softmax over the recorded experts' logits, or the full softmax's
  probabilities of them with ``moe_router_pre_softmax``), so the router keeps its gradient. Tokens without a
  recorded route (``-1``) keep the router's own top-k.

Both hook into Megatron-Core's own router-replay seam (``megatron/core/transformer/moe/router_replay.py``, 0.16.1:
``TopKRouter.router_replay.get_replay_topk`` is called with the routing scores where the top-k is taken; its
``REPLAY_FORWARD`` gathers the scores at the recorded indices, as verl's and Megatron's router replay do):
:class:`RouteReplay` subclasses Megatron's ``RouterReplay``, adds partial routes (``-1``) and counts the metric.

Megatron's router sees the tokens of a micro-batch sequence-first, flattened ``[s, b] -> s * b`` (under sequence
parallelism this TP rank's sequence chunk); :func:`route` rolls the batch's routes like the model inputs
(:func:`hybridrl.mcore.compute.prepare_batch`), cuts them to the micro-batch width and lays them out so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router_replay import RouterReplay

ROUTES_KEY = "rollout_routed_experts"
"""Batch key of the rollout's routes: ``(b, s, layers, k)`` integer expert ids, ``-1`` unknown."""
MISMATCH_METRIC = "moe/routing_mismatch"
"""Fraction of (response token, layer) pairs whose experts in the training forward differ from the rollout's."""
ROUTER_MISMATCH_METRIC = "moe/routing_mismatch_router"
"""Same, for the experts the training router would pick by itself (differs from the first under replay)."""
# (pairs, used != rollout, router != rollout) per layer and micro-batch since clear(), on the model's device: summed
# once per step, not read back per layer
_COUNTS: list[torch.Tensor] = []


class RouteReplay(RouterReplay):
    """One MoE layer's replay and metric state (set per micro-batch by :func:`route`).

    Args:
        layer: the layer's global 0-based index (the column of ``ROUTES_KEY``'s layer dim).
        replay: route to the recorded experts (else only count the metric).
    """

    def __init__(self, layer: int, replay: bool) -> None:
        super().__init__()
        # owned by its router, not by Megatron's process-wide list (several models may live in one process)
        RouterReplay.global_router_replay_instances.remove(self)
        self.layer, self.replay = layer, replay
        self.policy: torch.Tensor | None = None  # (tokens,) bool: pairs counted by the metric

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        """Top-k of ``scores`` ``(tokens, E)``: the recorded experts where known (with replay), else the router's."""
        values, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        target = self.target_topk_idx
        if target is None:
            return values, own
        if target.shape != own.shape:
            raise ValueError(
                f"{ROUTES_KEY} gives layer {self.layer} routes of shape {tuple(target.shape)} for a router input of "
                f"{tuple(own.shape)} (tokens, top-k); the batch's routes must come from this model's rollout"
            )
        target = target.to(own.device)
        known = (target >= 0).all(-1, keepdim=True)
        used = torch.where(known, target, own) if self.replay else own
        if self.policy is not None:
            recorded = torch.sort(target, -1).values
            policy = self.policy.to(own.device) & known.squeeze(-1)
            differs = [(torch.sort(x, -1).values != recorded).any(-1) & policy for x in (used, own)]
            _COUNTS.append(torch.stack([policy.sum(), *(d.sum() for d in differs)]))
        if not self.replay:
            return values, own
        return scores.gather(1, used), used


def keys_in(batch: Any, replay: bool = False) -> tuple[str, ...]:
    """``(ROUTES_KEY,)`` where ``batch`` (a mapping of tensors) carries the rollout's routes, else ``()``.

    Raises:
        RuntimeError: ``replay`` and no routes: replay would silently not happen.
    """
    if ROUTES_KEY in batch:
        return (ROUTES_KEY,)
    if replay:
        raise RuntimeError(
            f"actor.moe.routing_replay is on, but the rollout batch has no {ROUTES_KEY}: the rollout engine recorded "
            "no routes (an MoE model and single-turn vLLM generation record them)"
        )
    return ()


def routers(module: torch.nn.Module) -> Iterator[Any]:
    """The Megatron ``TopKRouter`` of every MoE layer in ``module`` (a model chunk, maybe DDP-wrapped)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return (m for m in module.modules() if isinstance(m, TopKRouter))


def install(chunks: list[torch.nn.Module], replay: bool) -> int:
    """Give every MoE router of ``chunks`` a :class:`RouteReplay`; returns how many (0 for a dense model).

    Args:
        chunks: the actor's model chunks.
        replay: route training forwards to the batch's recorded experts (``actor.moe.routing_replay``).
    """
    count = 0
    for chunk in chunks:
        for router in routers(chunk):
            router.router_replay = RouteReplay(router.layer_number - 1, replay)
            count += 1
    return count


def _flat_routes(micro_batch: dict[str, torch.Tensor], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(routes (s, b, L, k), policy (s, b))`` for the model inputs: rolled as ``prepare_batch`` rolls the tokens,
    cut to ``width``; ``policy`` marks response tokens with ``response_mask`` 1."""
    routes, mask = micro_batch[ROUTES_KEY], micro_batch["attention_mask"].long()
    b, s = mask.shape
    if routes.shape[:2] != (b, s):
        raise ValueError(
            f"{ROUTES_KEY} has shape {tuple(routes.shape)}; it must be (b, s, layers, k) with (b, s) = "
            f"{(b, s)} of input_ids"
        )
    r = micro_batch["responses"].shape[1]
    policy = torch.zeros_like(mask, dtype=torch.bool)
    policy[:, s - r :] = micro_batch.get("response_mask", mask[:, s - r :]).bool()
    index = (torch.arange(s, device=mask.device).unsqueeze(0) + mask.argmax(dim=1).unsqueeze(1)) % s
    rolled = routes.gather(1, index.view(b, s, 1, 1).expand_as(routes))[:, :width]
    return rolled.transpose(0, 1), policy.gather(1, index)[:, :width].transpose(0, 1)


def _sequence_chunk(x: torch.Tensor, config: Any) -> torch.Tensor:
    """This TP rank's sequence chunk under sequence parallelism (the router sees only it)."""
    if not config.sequence_parallel:
        return x
    from megatron.core import parallel_state as mpu

    tp, rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    return x.chunk(tp, dim=0)[rank]


@contextlib.contextmanager
def route(model: torch.nn.Module, micro_batch: dict[str, torch.Tensor]) -> Iterator[None]:
    """Within: ``model``'s routers replay / count against ``micro_batch[ROUTES_KEY]`` (no-op without routes or
    without :func:`install`). Wraps one forward of one micro-batch."""
    replays = [r.router_replay for r in routers(model) if isinstance(r.router_replay, RouteReplay)]
    if ROUTES_KEY not in micro_batch or not replays:
        yield
        return
    if "packed_index" in micro_batch:  # prompt sharing packs rows: no per-row routes (the metric is off then)
        if any(rep.replay for rep in replays):
            raise ValueError("actor.moe.routing_replay cannot follow packed rows; set actor.share_prompt_prefix=false")
        yield
        return
    from megatron.core.utils import get_model_config

    config = get_model_config(model)
    routes, policy = _flat_routes(micro_batch, micro_batch["model_input_ids"].shape[1])
    routes, policy = _sequence_chunk(routes, config), _sequence_chunk(policy, config)
    for rep in replays:
        if rep.layer >= routes.shape[2]:
            raise ValueError(f"{ROUTES_KEY} holds {routes.shape[2]} layers; layer {rep.layer} has no routes")
        rep.target_topk_idx = routes[:, :, rep.layer].reshape(-1, routes.shape[-1]).long()
        rep.policy = policy.reshape(-1)
    try:
        yield
    finally:
        for rep in replays:
            rep.target_topk_idx, rep.policy = None, None


def clear() -> None:
    """Forget the counts so far (call before the pass whose metric :func:`mismatch_metrics` reports)."""
    _COUNTS.clear()


def mismatch_metrics(config: Any) -> dict[str, float]:
    """``{MISMATCH_METRIC, ROUTER_MISMATCH_METRIC}`` since :func:`clear`, on every rank; empty when no pair was
    counted anywhere (dense model, no routes). Collective over the PP, DP (and, under sequence parallelism, TP)
    groups: call it on every rank of the model."""
    from megatron.core import parallel_state as mpu

    if getattr(config, "num_moe_experts", None) is None:
        return {}
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None  # NCCL: CUDA
    counts = torch.zeros(3, dtype=torch.float64, device=device)
    for c in _COUNTS:
        counts += c.to(counts.device, torch.float64)
    clear()
    groups = [mpu.get_pipeline_model_parallel_group(), mpu.get_data_parallel_group()]
    if config.sequence_parallel:
        groups.append(mpu.get_tensor_model_parallel_group())
    for group in groups:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
    if counts[0].item() == 0:
        return {}
    pairs = counts[0].item()
    return {MISMATCH_METRIC: counts[1].item() / pairs, ROUTER_MISMATCH_METRIC: counts[2].item() / pairs}
