"""Section 6 of tests/gpu/check.py: the role workers through their ``WorkerGroup`` on one device (world 1).

The GPU-only paths of the workers, fixed by reading and never run on a GPU before: ``DP_COMPUTE`` chunks moved
to the rank's CUDA device and results gathered back to the CPU (``workers/dispatch.py``); the critic's weights
and optimizer state parked in host memory between its updates (Megatron DDP buffers) and brought home by
``resident()`` for a checkpoint save; ``load_role``'s agreement all-reduce on an NCCL device tensor; the value
head built on the model's device; the reward model's padding on the batch's device.

A tiny HF Llama (``tests/mcore/hf_tiny.py``), fp32 (TF32 off), config ``tiny_cpu.yaml`` cut to world 1. For each
critic optimizer backend, ``megatron`` (on the GPU: DDP + DistributedOptimizer, the default there) and ``torch``
(plain AdamW; its ``load_role`` all-reduces the agreement flag): values vs HF on the CPU, an update that parks the
critic, a save inside ``resident()`` and a load into a fresh critic. Then the reference's log-probs and the reward
model's scores vs HF. On the CPU (dry run) offload is a no-op: the parking checks are reported as n/a.
"""

from __future__ import annotations

import math
import os
import tempfile
import traceback

import torch

from tests.gpu.report import PARITY_TOL, Report, log
from tests.mcore import hf_tiny

P, R = 8, 6  # prompt and response widths of the batch
PROMPT_LENS, RESPONSE_LENS = (8, 3, 6, 5), (6, 2, 4, 1)


def _batch() -> dict[str, torch.Tensor]:
    """What rollout produces, on the CPU (the trainer's loop holds its batches there): prompts of different
    lengths left-padded, responses of different lengths right-padded."""
    g = torch.Generator().manual_seed(11)
    ids = torch.zeros(len(PROMPT_LENS), P + R, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS, strict=True)):
        ids[i, P - p : P + r] = torch.randint(1, hf_tiny.VOCAB, (p + r,), generator=g)
        mask[i, P - p : P + r] = 1
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids,
            "responses": ids[:, P:].clone(), "response_mask": mask[:, P:].clone()}  # fmt: skip


def _hf_reference(lm_path: str, score_path: str, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF transformers on the CPU in fp32 (independent of Megatron and of the device): the causal LM's response
    log-probs, the classifier's per-token score at the position predicting each response token (the critic's
    values) and at each response's last token (the reward model's score)."""
    import transformers

    kw = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    load = {"dtype": torch.float32, "attn_implementation": "eager"}
    lm = transformers.AutoModelForCausalLM.from_pretrained(lm_path, **load).eval()
    cls = transformers.AutoModelForSequenceClassification.from_pretrained(score_path, **load).eval()
    with torch.no_grad():
        logp = torch.log_softmax(lm(**kw).logits[:, P - 1 : -1].double(), dim=-1)
        scores = cls.score(cls.model(**kw).last_hidden_state)[..., 0]
    last = torch.tensor([P + r - 1 for r in RESPONSE_LENS])
    return {"ref_log_probs": logp.gather(-1, batch["responses"][..., None])[..., 0].float(),
            "values": scores[:, P - 1 : -1], "rm_scores": scores[torch.arange(len(last)), last]}  # fmt: skip


def _config(score_path: str, backend: str):
    from hybridrl.config import load_config

    overrides = [
        "trainer.n_gpus_per_node=1", "actor.megatron.tp_size=1", "model.dtype=float32", "critic.enable=true",
        "critic.param_offload=true", "critic.optimizer_offload=true", f"critic.optim.backend={backend}",
        "critic.optim.lr=1e-3", "critic.ppo_mini_batch_size=4", "critic.ppo_micro_batch_size_per_gpu=2",
        "ref.param_offload=true", "reward.model.enable=true", f"reward.model.path={score_path}",
        "reward.model.param_offload=true", "reward.model.micro_batch_size_per_gpu=3",  # 4 rows: a padded micro-batch
    ]  # fmt: skip
    return load_config("tiny_cpu.yaml", overrides, world_size=1)


def _diff(got: torch.Tensor, want: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    d = (got.float() - want.float()).abs()
    return (d * mask if mask is not None else d).max().item()


def _on_cpu(t: torch.Tensor, shape: tuple[int, ...]) -> bool:
    return t.device.type == "cpu" and tuple(t.shape) == shape and bool(torch.isfinite(t).all())


def _weights(worker) -> dict[str, torch.Tensor]:
    return {f"{i}.{n}": p.detach().cpu().clone() for i, c in enumerate(worker.model.chunks)
            for n, p in c.named_parameters()}  # fmt: skip


def _parked(worker) -> dict[str, bool]:
    """Whether the critic's weights, gradients and optimizer state are all in host memory."""
    from hybridrl.mcore.optimizer import _torch_optimizers

    bufs = [b for c in worker.optimizer.chunks if hasattr(c, "offload_grad_buffers") for b in c.buffers]
    params = list(worker.model.parameters())
    if bufs and all(b.param_data is not None for b in bufs):  # weights are views of DDP's param buffers
        weights = all(
            b.param_data.untyped_storage().size() == 0 and getattr(b, "param_data_cpu", None) is not None for b in bufs
        )
    else:
        weights = all(p.device.type == "cpu" for p in params)
    grads = all(b.grad_data.untyped_storage().size() == 0 for b in bufs) and all(p.grad is None for p in params)
    state = [v for opt in _torch_optimizers(worker.optimizer) for s in opt.state.values() for v in s.values()
             if torch.is_tensor(v)]  # fmt: skip
    return {"weights_on_host": weights, "grads_freed": grads,
            "optimizer_state_on_host": bool(state) and all(v.device.type == "cpu" for v in state)}  # fmt: skip


def _critic_class(cfg, score_path: str):
    """The critic worker with the arguments the trainer's ``role_workers`` gives it."""
    from hybridrl.config.checks import optimizer_steps
    from hybridrl.workers import ClassWithInitArgs
    from hybridrl.workers.megatron_workers import CriticWorker

    steps = optimizer_steps(cfg, "critic")
    return ClassWithInitArgs(
        CriticWorker, cfg.critic, score_path, cfg.model.dtype, steps, cfg.rollout.n, cfg.actor.shuffle
    )


def _critic(report: Report, pool, backend: str, score_path: str, batch: dict, ref: dict, tmp: str) -> None:
    from hybridrl.mcore.checkpoint import load_role, save_role
    from hybridrl.protocol import DataProto
    from hybridrl.workers import WorkerGroup

    cuda, name, mask = torch.cuda.is_available(), f"workers.critic_{backend}", batch["response_mask"]
    cfg = _config(score_path, backend)
    group = WorkerGroup(pool, _critic_class(cfg, score_path))
    w = group.worker
    values = group.compute_values(DataProto.from_dict(tensors=batch)).batch["values"]
    diff = _diff(values, ref["values"], mask)
    report.check(f"{name}.compute_values", _on_cpu(values, tuple(mask.shape)) and diff <= PARITY_TOL,
                 device=str(values.device), max_abs_diff=diff, optimizer=type(w.optimizer).__name__)  # fmt: skip

    before, held = _weights(w), torch.cuda.memory_allocated() if cuda else 0
    returns = values + torch.randn(values.shape, generator=torch.Generator().manual_seed(3))
    out = group.update_critic(DataProto.from_dict(tensors={**batch, "values": values, "returns": returns}))
    freed = held - torch.cuda.memory_allocated() if cuda else 0
    m = out.meta_info["metrics"]
    with w.resident():
        after = _weights(w)
    changed = any(not torch.equal(before[k], after[k]) for k in before)
    ok = all(math.isfinite(m.get(k, math.nan)) for k in ("critic/loss", "critic/grad_norm")) and changed
    report.check(f"{name}.update_critic", ok, loss=m.get("critic/loss"), grad_norm=m.get("critic/grad_norm"),
                 weights_changed=changed)  # fmt: skip
    weight_bytes = sum(p.numel() * p.element_size() for p in w.model.parameters())
    if cuda:
        state = _parked(w)
        report.check(f"{name}.parked_after_update", all(state.values()) and freed >= 0.9 * weight_bytes,
                     freed_mib=freed / 2**20, weights_mib=weight_bytes / 2**20, **state)  # fmt: skip
    else:
        log(f"  [n/a] {name}.parked_after_update: offload is a no-op on CPU")

    path = os.path.join(tmp, f"critic_{backend}")
    with w.resident():  # parked weights are zero-size DDP storage: the save must find them home
        save_role(w.model, w.optimizer, path)
    parked_again = all(_parked(w).values()) if cuda else True
    fresh_group = WorkerGroup(pool, _critic_class(cfg, score_path))
    fresh = fresh_group.worker
    restored = load_role(fresh.model, fresh.optimizer, path)  # torch backend: the agreement all-reduce
    loaded = _weights(fresh)
    same = loaded.keys() == after.keys() and all(torch.equal(loaded[k], after[k]) for k in after)
    report.check(f"{name}.save_resident_load_role", restored and same and parked_again, optimizer_restored=restored,
                 weights_equal=same, parked_again=parked_again if cuda else "n/a on CPU")  # fmt: skip
    # the next step's values from the parked critic: its weights must come home (they stayed on the CPU when not
    # in DDP buffers) and give what the freshly loaded copy gives
    again = group.compute_values(DataProto.from_dict(tensors=batch)).batch["values"]
    want = fresh_group.compute_values(DataProto.from_dict(tensors=batch)).batch["values"]
    diff = _diff(again, want, mask)
    report.check(f"{name}.values_after_parking", _on_cpu(again, tuple(mask.shape)) and diff <= PARITY_TOL,
                 max_abs_diff=diff, changed_by_update=_diff(again, values, mask))  # fmt: skip
    del group, w, fresh, fresh_group


def section_workers(report: Report, device: torch.device) -> dict:
    try:
        import hybridrl.config  # noqa: F401  (the workers take config sections)
    except ModuleNotFoundError as e:
        raise RuntimeError(f"{e}: add the omegaconf wheel to .whl/ (tests/gpu/README.md)") from e
    from hybridrl.distributed import ParallelLayout, init_model_parallel
    from hybridrl.protocol import DataProto
    from hybridrl.workers import ClassWithInitArgs, ResourcePool, WorkerGroup
    from hybridrl.workers.megatron_workers import ReferenceWorker, RewardModelWorker

    init_model_parallel(ParallelLayout.from_world(1))
    pool = ResourcePool(process_on_nodes=[1], use_gpu=device.type == "cuda")
    batch = _batch()
    mask, n = batch["response_mask"], len(PROMPT_LENS)
    with tempfile.TemporaryDirectory() as tmp:
        lm = hf_tiny.make_checkpoint("llama", os.path.join(tmp, "lm"), seed=31)
        score = hf_tiny.make_checkpoint("llama", os.path.join(tmp, "score"), seed=32, score=True)
        ref = _hf_reference(lm, score, batch)
        for backend in ("megatron", "torch"):
            try:
                _critic(report, pool, backend, score, batch, ref, tmp)
            except Exception as e:  # the other backend and the frozen roles still run
                report.check(f"workers.critic_{backend}", False, error=f"{type(e).__name__}: {e}")
                log(traceback.format_exc())
            if device.type == "cuda":
                torch.cuda.empty_cache()

        cfg = _config(score, "torch")
        ref_args = (cfg.ref, lm, cfg.model.dtype, cfg.rollout.temperature)  # what the trainer's role_workers passes
        group = WorkerGroup(pool, ClassWithInitArgs(ReferenceWorker, *ref_args))
        lp = group.compute_ref_log_prob(DataProto.from_dict(tensors=batch)).batch["ref_log_probs"]
        diff = _diff(lp, ref["ref_log_probs"], mask)
        home = group.worker.model.offloaded and all(p.device.type == "cpu" for p in group.worker.model.parameters())
        report.check("workers.reference.compute_ref_log_prob", _on_cpu(lp, tuple(mask.shape)) and diff <= PARITY_TOL
                     and home, device=str(lp.device), max_abs_diff=diff, offloaded_again=home)  # fmt: skip

        group = WorkerGroup(pool, ClassWithInitArgs(RewardModelWorker, cfg.reward.model, score, cfg.model.dtype))
        rm = group.compute_rm_score(DataProto.from_dict(tensors=batch)).batch["rm_scores"]
        diff = _diff(rm, ref["rm_scores"])
        home = group.worker.model.offloaded
        report.check("workers.reward_model.compute_rm_score", _on_cpu(rm, (n,)) and diff <= PARITY_TOL and home,
                     device=str(rm.device), max_abs_diff=diff, offloaded_again=home)  # fmt: skip
    return {}
