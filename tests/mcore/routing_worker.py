"""run_ranks body of test_moe_routing.py: the routing metric and replay through the trainer's builders.

On each layout (2 ranks: DP2, EP2, PP2) every checkpoint is built as the actor worker builds it
(``roles.build_actor`` + ``routing.install``); each rank passes its data-parallel shard of a batch that carries
``rollout_routed_experts`` through ``compute.forward_backward`` (the update's path: metrics, and a backward so the
router's gradient under replay is read) and ``compute.compute_log_probs`` (the old-log-prob path), with replay
off and on. Results are every rank's.
"""

from __future__ import annotations

LAYOUTS = {"dp2": {}, "ep2": {"ep": 2}, "pp2": {"pp": 2}}


def actor_loss(outputs, mb):
    """``-A_t * log pi(y_t)`` per token."""
    return -mb["advantages"] * outputs["log_probs"], {}


def _local(batch: dict) -> dict:
    from megatron.core import parallel_state as mpu

    b = next(iter(batch.values())).shape[0]
    rank, size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    return {k: v[rank * b // size : (rank + 1) * b // size] for k, v in batch.items()}


def _options() -> dict:
    from hybridrl.config.schema_roles import MegatronConfig
    from hybridrl.workers.megatron_workers import model_options

    return model_options(MegatronConfig(), "actor.megatron")


def _router_grads(chunks) -> dict:
    from hybridrl.mcore.bridge import global_parameters

    return {n: p.grad.detach().clone() for n, p in global_parameters(chunks) if "router" in n and p.grad is not None}


def run_case(path: str, batch: dict) -> dict:
    """Metrics and log-probs with replay off, then on; the router gradients of one update with replay."""
    from hybridrl.mcore import compute, roles, routing

    model = roles.build_actor(path, **_options())
    out: dict = {"routers": routing.install(model.chunks, replay=False)}
    local = _local(batch)
    for replay in (False, True):
        for router in routing.routers(model.chunks[0]):
            router.router_replay.replay = replay
        for p in model.chunks[0].parameters():
            p.grad = None
        step = compute.forward_backward(model.chunks, local, actor_loss, 1)
        out[("metrics", replay)] = step.metrics
        out[("log_probs", replay)] = compute.compute_log_probs(model.chunks, local, 1, gather_dp=True)["log_probs"]
        out[("router_grads", replay)] = _router_grads(model.chunks)
    plain = {k: v for k, v in local.items() if k != routing.ROUTES_KEY}
    out["log_probs_plain"] = compute.compute_log_probs(model.chunks, plain, 1, gather_dp=True)["log_probs"]
    return out


def body(rank: int, world: int, spec: dict) -> dict:
    from hybridrl.distributed import ParallelLayout, init_model_parallel
    from tests.mcore import hf_tiny

    out: dict = {}
    for name in spec["layouts"]:
        init_model_parallel(ParallelLayout.from_world(world, **LAYOUTS[name]))
        for arch, case in spec["cases"].items():
            out[(name, arch)] = run_case(case["path"], case["batch"])
    return hf_tiny.portable(out)
