"""torchrun worker of test_grad_norm_hf.py: one optimizer step of every role through the trainer's builders.

    torchrun --nproc-per-node N -m tests.mcore.grad_norm_worker SPEC_FILE RESULT_FILE

SPEC_FILE (torch.save) names the HF folders (before and after HF's own step), the batch, the optimizer
settings and the layouts. On each layout, for each case (two actors, one critic) and optimizer backend, the
role is built exactly as the workers build it (``roles.build_actor`` / ``build_critic`` with
``model_options``, ``build_optimizer(optim_config(...))``), trained one step with ``compute.forward_backward``
(the actor's default log-prob head: the vocabulary comes from the model), and compared with the HF model
after HF's step as the bridge loads it onto the same layout (each rank checks its own shards). Rank 0 writes
RESULT_FILE with every rank's numbers. A torchrun launch, not run_ranks: the checkpoint-resume check saves
with dist_checkpointing, which starts processes (a daemonic run_ranks child may not).
"""

from __future__ import annotations

import os
import sys

import torch

ATTR_NAMES = ("tensor_model_parallel", "partition_dim", "partition_stride")
DEFAULTS = (False, -1, 1)  # Megatron's replicated defaults (_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS)


def actor_loss(outputs, mb):
    """Policy-gradient form: ``-A_t * log pi(y_t)`` per token (token-mean aggregation by the caller)."""
    return -mb["advantages"] * outputs["log_probs"], {}


def critic_loss(outputs, mb):
    """``0.5 * (V_t - R_t)^2`` per token."""
    return 0.5 * (outputs["values"] - mb["returns"]).square(), {}


def _attrs(param, strict: bool) -> tuple:
    """The three attributes; ``strict=False`` reads a missing one as Megatron's default (as its readers do)."""
    if strict:
        return tuple(getattr(param, a) if hasattr(param, a) else "missing" for a in ATTR_NAMES)
    return tuple(getattr(param, a, d) for a, d in zip(ATTR_NAMES, DEFAULTS, strict=True))


SEQUENCE_PARALLEL = False
"""The roles' ``megatron.sequence_parallel`` on the current layout (a layout's ``sequence_parallel`` key)."""


def _builder(role: str):
    from hybridrl.mcore import roles

    return roles.build_actor if role == "actor" else roles.build_critic


def _build(role: str, path: str, **overrides):
    """The role's model as the workers build it (MegatronConfig defaults -> model_options)."""
    from hybridrl.config.schema_roles import MegatronConfig
    from hybridrl.workers.megatron_workers import model_options

    options = model_options(MegatronConfig(sequence_parallel=SEQUENCE_PARALLEL), f"{role}.megatron")
    return _builder(role)(path, dtype=torch.float32, **options, **overrides)


def train_step(case: dict, backend: str, spec: dict) -> dict:
    """One step of ``case`` with optimizer ``backend``; this rank's numbers."""
    from hybridrl.config.schema_roles import MegatronConfig
    from hybridrl.config.schema_roles import OptimConfig as OptimSection
    from hybridrl.mcore import compute
    from hybridrl.mcore.bridge import global_parameters
    from hybridrl.mcore.optimizer import build_optimizer
    from hybridrl.workers.megatron_workers import optim_config

    model = _build(case["role"], case["path"])
    o = spec["optim"]
    section = OptimSection(lr=o["lr"], weight_decay=o["wd"], betas=list(o["betas"]), eps=o["eps"],
                           clip_grad=case["clip"], backend=backend)  # fmt: skip
    opt = build_optimizer(model.chunks, optim_config(section, total_steps=1, megatron=MegatronConfig()))
    before = {n: p.detach().clone() for n, p in global_parameters(model.chunks)}
    opt.zero_grad()
    head = None if case["role"] == "actor" else compute.ValuesHead()  # None: LogProbHead bound to the model
    loss_fn = actor_loss if case["role"] == "actor" else critic_loss
    step = compute.forward_backward(opt.chunks, dict(spec["batch"]), loss_fn, 1, head=head)
    result = opt.step()
    expected = dict(global_parameters(_build(case["role"], case["after"]).chunks))
    weights, update = 0.0, 0.0
    for name, p in global_parameters(model.chunks):
        ref, mine = expected[name], p.detach()
        weights = max(weights, ((mine - ref).abs().max() / ref.abs().max().clamp(min=1e-12)).item())
        hf_delta, delta = ref - before[name], mine - before[name]
        if hf_delta.abs().max() > 0:
            update = max(update, ((delta - hf_delta).abs().max() / hf_delta.abs().max()).item())
    return {"norm": result.grad_norm, "skipped": result.skipped, "loss": step.loss, "weights": weights,
            "update": update, "moved": max((expected[n] - before[n]).abs().max().item() for n in before)}  # fmt: skip


def attribute_diffs(role: str, path: str, model=None) -> list[str]:
    """Parameters whose tensor-parallel attributes are missing, or differ from what Megatron's own init sets
    (the same builder with ``perform_initialization=True``)."""
    from hybridrl.mcore.bridge import global_parameters

    model = model or _build(role, path)
    megatron = dict(global_parameters(_build(role, path, perform_initialization=True).chunks))
    out = []
    for name, p in global_parameters(model.chunks):
        have, want = _attrs(p, strict=True), _attrs(megatron[name], strict=False)
        if have != want:
            out.append(f"{name}: {have} != Megatron's {want}")
    return out


def role_attributes(spec: dict, ckpt_dir: str) -> dict:
    """Every role and build path on this layout: attribute diffs (empty lists expected)."""
    import torch.distributed as dist

    from hybridrl.mcore import checkpoint, roles
    from hybridrl.mcore.bridge import global_parameters
    from hybridrl.mcore.optimizer import OptimConfig, build_optimizer

    lm, cls = spec["cases"]["qwen2_actor"]["path"], spec["cases"]["qwen2_critic"]["path"]
    r = {
        "actor": attribute_diffs("actor", lm),
        "reference": attribute_diffs("actor", lm, roles.build_reference(lm, offload=True)),
        "critic_from_lm": attribute_diffs("critic", lm),
        "critic": attribute_diffs("critic", cls),
        "reward": attribute_diffs("critic", cls, roles.build_reward_model(cls)),
        "tied_actor": attribute_diffs("actor", spec["cases"]["qwen3_actor"]["path"]),
    }
    for role, path in (("actor", lm), ("critic", cls)):  # checkpoint resume: save_role -> rebuild / load_role
        model = _build(role, path)
        opt = build_optimizer(model.chunks, OptimConfig(backend="torch"))
        checkpoint.save_role(model, opt, os.path.join(ckpt_dir, role))
        dist.barrier()  # save_role's rank 0 writes config.json after the collective part
        r[f"{role}_from_checkpoint"] = attribute_diffs(role, path, checkpoint.build_from_checkpoint(
            os.path.join(ckpt_dir, role), role))  # fmt: skip
        resumed = _build(role, path)
        checkpoint.load_role(resumed, build_optimizer(resumed.chunks, OptimConfig(backend="torch")),
                             os.path.join(ckpt_dir, role))  # fmt: skip
        r[f"{role}_resumed"] = attribute_diffs(role, path, resumed)
    broken = _build("actor", lm)
    param = next(p for n, p in global_parameters(broken.chunks) if n.endswith("linear_fc2.weight"))
    for attr in ATTR_NAMES:
        if hasattr(param, attr):
            delattr(param, attr)
    try:
        build_optimizer(broken.chunks, OptimConfig(backend="torch"))
        r["invariant_error"] = ""
    except RuntimeError as err:
        r["invariant_error"] = str(err)
    dist.barrier()
    return r


def vocab_checks(spec: dict) -> dict:
    """Public functions WITHOUT vocab_size on the odd-vocab actor: log-probs, entropy, labels cross entropy."""
    import torch.distributed as dist

    from hybridrl.mcore import compute, gpt

    actor = _build("actor", spec["cases"]["qwen3_actor"]["path"])
    out = compute.compute_log_probs(actor.chunks, dict(spec["batch"]), 2, with_entropy=True)
    r = {"log_probs": out["log_probs"], "entropy": out["entropy"]}
    ids = spec["lm_ids"]
    batch = {"input_ids": ids, "position_ids": torch.arange(ids.shape[1]).expand_as(ids).contiguous(),
             "labels": torch.roll(ids, -1, dims=1)}  # fmt: skip
    metrics = gpt.forward_backward(actor.chunks, [batch], lambda ce, _: (ce.mean(), {"ce": ce.detach()}), True)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, metrics[0]["ce"] if metrics else None)
    r["ce"] = next(c for c in everyone if c is not None)
    try:
        zeros = torch.zeros(1, 1, dtype=torch.long)
        compute.LogProbHead()(torch.zeros(1, 2, 4), {"response_positions": zeros, "responses": zeros})
        r["unbound_error"] = ""
    except ValueError as err:
        r["unbound_error"] = str(err)
    try:
        compute.compute_log_probs(actor.chunks, dict(spec["batch"]), 2, vocab_size=actor.shape.padded_vocab)
        r["mismatch_error"] = ""
    except ValueError as err:
        r["mismatch_error"] = str(err)
    return r


def main(spec_file: str, result_file: str) -> None:
    import torch.distributed as dist

    from hybridrl.distributed import ParallelLayout, init_distributed, init_model_parallel

    init_distributed()
    spec = torch.load(spec_file, weights_only=False)
    mine: dict = {}
    global SEQUENCE_PARALLEL
    for layout_name, layout in spec["layouts"].items():
        layout = dict(layout)
        SEQUENCE_PARALLEL = layout.pop("sequence_parallel", False)
        init_model_parallel(ParallelLayout.from_world(dist.get_world_size(), **layout))
        for case_name, case in spec["cases"].items():
            for backend in spec["backends"]:
                mine[(layout_name, case_name, backend)] = train_step(case, backend, spec)
            mine[(layout_name, case_name, "attributes")] = attribute_diffs(case["role"], case["path"])
        if layout_name in spec.get("vocab_layouts", ()):
            mine[(layout_name, "vocab")] = vocab_checks(spec)
        if layout_name == spec.get("roles_layout"):
            mine[(layout_name, "roles")] = role_attributes(spec, os.path.join(os.path.dirname(result_file), "ckpt"))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        torch.save(everyone, result_file)
    dist.barrier()
    # As the trainer does: a gloo group still alive at interpreter exit can abort a rank in its C++ teardown
    # ("terminate called without an active exception") after every check has passed.
    from hybridrl.mcore import parallel_state

    parallel_state.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
