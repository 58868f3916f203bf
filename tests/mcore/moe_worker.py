"""run_ranks body of test_moe_parity.py: MoE roles through the trainer's builders on several layouts.

On each layout (2 ranks: DP2, EP2 (experts split over the two DP ranks), PP2, TP2 with sequence parallelism;
TP2 without it for the frozen reference, see test_moe_parity.py), every checkpoint is built as the workers build
it (``roles.build_actor`` with ``model_options`` of a ``MegatronConfig``: the default one, sequence parallelism on
the TP2 layout); each rank gives its data-parallel shard of the batch to ``compute.compute_log_probs``; the step
cases run one ``forward_backward`` + optimizer step (torch backend, the CPU path) and are compared, shard by shard,
with HF's model after HF's own step as the bridge loads it; the export case writes the model back to an HF folder
(collective). Results are rank 0's, plus every rank's step.
"""

from __future__ import annotations

LAYOUTS = {"dp2": {}, "ep2": {"ep": 2}, "pp2": {"pp": 2}, "tp2_sp": {"tp": 2, "sequence_parallel": True}}
SEQUENCE_PARALLEL = False
"""``actor.megatron.sequence_parallel`` on the current layout (a layout's ``sequence_parallel`` key)."""


def actor_loss(outputs, mb):
    """``-A_t * log pi(y_t)`` per token (token-mean over the global batch by the caller)."""
    return -mb["advantages"] * outputs["log_probs"], {}


def _shard(batch: dict, rank: int, size: int) -> dict:
    b = next(iter(batch.values())).shape[0]
    rows = slice(rank * b // size, (rank + 1) * b // size)
    return {k: v[rows] for k, v in batch.items()}


def _options() -> dict:
    from hybridrl.config.schema_roles import MegatronConfig
    from hybridrl.workers.megatron_workers import model_options

    return model_options(MegatronConfig(sequence_parallel=SEQUENCE_PARALLEL), "actor.megatron")


def _local(batch: dict) -> dict:
    from megatron.core import parallel_state as mpu

    return _shard(batch, mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size())


def train_step(case: dict, batch: dict, optim: dict) -> dict:
    """One actor step on this rank's DP shard; grad norm, aux metric, max deviation from HF's step."""
    from hybridrl.config.schema_roles import MegatronConfig
    from hybridrl.config.schema_roles import OptimConfig as OptimSection
    from hybridrl.mcore import compute, moe, roles
    from hybridrl.mcore.bridge import global_parameters
    from hybridrl.mcore.optimizer import build_optimizer
    from hybridrl.workers.megatron_workers import optim_config

    model = roles.build_actor(case["path"], **_options())
    section = OptimSection(lr=optim["lr"], weight_decay=optim["wd"], betas=list(optim["betas"]), eps=optim["eps"],
                           clip_grad=case["clip"], backend="torch")  # fmt: skip
    opt = build_optimizer(model.chunks, optim_config(section, total_steps=1, megatron=MegatronConfig()))
    before = {n: p.detach().clone() for n, p in global_parameters(model.chunks)}
    opt.zero_grad()
    step = compute.forward_backward(opt.chunks, _local(batch), actor_loss, 1)
    result = opt.step()
    expected = dict(global_parameters(roles.build_actor(case["after"], **_options()).chunks))
    weights, update = 0.0, 0.0
    for name, p in global_parameters(model.chunks):
        ref, mine = expected[name], p.detach()
        weights = max(weights, ((mine - ref).abs().max() / ref.abs().max().clamp(min=1e-12)).item())
        hf_delta, delta = ref - before[name], mine - before[name]
        if hf_delta.abs().max() > 0:
            update = max(update, ((delta - hf_delta).abs().max() / hf_delta.abs().max()).item())
    experts = sum(1 for n in before if "experts" in n)
    return {"norm": result.grad_norm, "skipped": result.skipped, "weights": weights, "update": update,
            "aux": step.metrics.get(moe.AUX_LOSS_METRIC), "experts": experts}  # fmt: skip


def body(rank: int, world: int, spec: dict) -> dict:
    from hybridrl.distributed import ParallelLayout, init_model_parallel
    from hybridrl.mcore import compute, roles
    from tests.mcore import hf_tiny

    global SEQUENCE_PARALLEL
    out: dict = {}
    for name, lay in LAYOUTS.items():
        lay = dict(lay)
        SEQUENCE_PARALLEL = lay.pop("sequence_parallel", False)
        init_model_parallel(ParallelLayout.from_world(world, **lay))
        for arch, case in spec["cases"].items():
            actor = roles.build_actor(case["path"], **_options())
            logp = compute.compute_log_probs(actor.chunks, _local(spec["padded"]), 1, gather_dp=True)
            out[(name, arch, "log_probs")] = logp["log_probs"]
            if name in spec["export_layouts"] and arch == spec["export_arch"]:
                actor.export(f"{spec['out']}/{name}")
            if "after" in case:
                out[(name, arch, "step", rank)] = train_step(case, spec["full"], spec["optim"])
    SEQUENCE_PARALLEL = False
    init_model_parallel(ParallelLayout.from_world(world, tp=2))
    for arch, case in spec["cases"].items():  # a frozen role (eval mode): Megatron's MoE trains only with SP at TP>1
        ref = roles.build_reference(case["path"], **_options())
        out[("tp2", arch, "log_probs")] = compute.compute_log_probs(ref.chunks, spec["padded"], 1)["log_probs"]
        if arch == spec["export_arch"]:
            ref.export(f"{spec['out']}/tp2")
    return hf_tiny.portable(out)
