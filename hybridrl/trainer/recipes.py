"""The SFT and DPO recipes: their worker groups, one step and one validation pass each, and their entry point.

    torchrun --nproc-per-node 2 -m hybridrl sft tiny_cpu_sft.yaml
    torchrun --nproc-per-node 2 -m hybridrl dpo tiny_cpu_dpo.yaml dpo.loss_type=ipo

A recipe is the roles it registers in worker groups plus what a step asks of them; the loop is
:class:`hybridrl.trainer.offline.OfflineTrainer`:

- :class:`SFTRecipe`: the policy (:class:`~hybridrl.workers.recipe_workers.SFTWorker`) takes one optimizer step
  per batch on the next-token loss of the assistant tokens; validation: that loss over the validation set.
- :class:`DPORecipe`: per batch of ``k`` pairs (``2k`` rows), the reference's sequence log-probs (the RL
  trainer's :class:`~hybridrl.workers.megatron_workers.ReferenceWorker`; none for a reference-free loss) and the
  policy's (forward only) give each sequence its loss weight (:func:`hybridrl.algos.preference.sequence_weights`);
  the policy (:class:`~hybridrl.workers.recipe_workers.DPOWorker`) then takes one step on the weighted log-probs,
  whose gradient is the preference loss's. Validation: the preference metrics over the validation pairs.

Start-up order as ``hybridrl train``'s (:mod:`hybridrl.trainer.main`): config (every check) -> environment ->
Megatron groups -> inputs (the demo's when ``data.demo_task``) -> datasets (bad rows: one line) -> workers -> fit.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.algos.preference import sequence_weights
from hybridrl.config import RunConfig
from hybridrl.protocol import DataProto
from hybridrl.workers import ClassWithInitArgs, ResourcePool, WorkerGroup
from hybridrl.workers.megatron_workers import ReferenceWorker
from hybridrl.workers.recipe_workers import DPOWorker, SFTWorker


def _sequence_log_probs(per_token: torch.Tensor, batch: DataProto) -> torch.Tensor:
    """``(b,)`` sums of ``(b, r)`` per-token log-probs over the trained tokens."""
    return (per_token * batch.batch["response_mask"]).sum(-1)


class SFTRecipe:
    """Supervised fine-tuning of the policy (module docs).

    Args:
        cfg: the resolved run config (``trainer.total_steps`` set).
        pool: the run's resource pool.
        model_path: HF folder of the starting model.
    """

    name = "sft"

    def __init__(self, cfg: RunConfig, pool: ResourcePool, model_path: str) -> None:
        worker = ClassWithInitArgs(SFTWorker, cfg.actor, cfg.sft, model_path, cfg.model.dtype, cfg.trainer.total_steps)
        self.policy = WorkerGroup(pool, worker)

    def parts(self) -> dict[str, Any]:
        return {"actor": self.policy}

    def train_step(self, batch: DataProto) -> dict[str, float]:
        metrics = dict(self.policy.update_sft(batch).meta_info["metrics"])
        metrics["sft/tokens"] = float(batch.batch["response_mask"].sum())
        return metrics

    def validate(self, batches: list[DataProto]) -> dict[str, float]:
        """``val/sft/loss``: the mean next-token loss over every trained token of the validation set."""
        total, count = 0.0, 0.0
        for batch in batches:
            log_probs = self.policy.compute_log_prob(batch).batch["log_probs"]
            total -= float(_sequence_log_probs(log_probs, batch).sum())
            count += float(batch.batch["response_mask"].sum())
        return {"val/sft/loss": total / max(count, 1.0)}


class DPORecipe:
    """Preference optimisation of the policy against the reference (module docs); arguments as :class:`SFTRecipe`."""

    name = "dpo"

    def __init__(self, cfg: RunConfig, pool: ResourcePool, model_path: str) -> None:
        d = cfg.dpo
        self.options = dict(loss_type=d.loss_type, beta=d.beta, label_smoothing=d.label_smoothing,
                            simpo_gamma=d.simpo_gamma)  # fmt: skip
        worker = ClassWithInitArgs(DPOWorker, cfg.actor, model_path, cfg.model.dtype, cfg.trainer.total_steps)
        self.policy = WorkerGroup(pool, worker)
        self.ref = None
        if cfg.ref.enable:  # log-probs at temperature 1: the reward is a ratio of the models' own distributions
            self.ref = WorkerGroup(pool, ClassWithInitArgs(ReferenceWorker, cfg.ref, model_path, cfg.model.dtype, 1.0))

    def parts(self) -> dict[str, Any]:
        return {"actor": self.policy}  # the frozen reference is rebuilt from model.path

    def _log_probs(self, batch: DataProto) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Policy and reference sequence log-probs ``(2k,)`` of a batch."""
        policy = _sequence_log_probs(self.policy.compute_log_prob(batch).batch["log_probs"], batch)
        if self.ref is None:
            return policy, None
        return policy, _sequence_log_probs(self.ref.compute_ref_log_prob(batch).batch["ref_log_probs"], batch)

    def train_step(self, batch: DataProto) -> dict[str, float]:
        policy, ref = self._log_probs(batch)
        weights, metrics = sequence_weights(policy, ref, batch.batch["response_mask"].sum(-1), **self.options)
        batch.batch["seq_weights"] = weights.float()
        metrics.update(self.policy.update_preference(batch).meta_info["metrics"])
        return metrics

    def validate(self, batches: list[DataProto]) -> dict[str, float]:
        """The preference metrics (``val/dpo/loss``, ``accuracy``, ``margin``, rewards) over all validation pairs."""
        parts: list[list[torch.Tensor]] = [[], [], [], [], [], []]
        for batch in batches:
            k = len(batch) // 2
            policy, ref = self._log_probs(batch)
            lengths = batch.batch["response_mask"].sum(-1)
            for i, t in enumerate((policy[:k], policy[k:], lengths[:k], lengths[k:])):
                parts[i].append(t)
            if ref is not None:
                parts[4].append(ref[:k])
                parts[5].append(ref[k:])
        policy = torch.cat(parts[0] + parts[1])
        lengths = torch.cat(parts[2] + parts[3])
        ref = torch.cat(parts[4] + parts[5]) if parts[4] else None
        _, metrics = sequence_weights(policy, ref, lengths, **self.options)
        return {f"val/{k}": v for k, v in metrics.items()}


RECIPES = {"sft": SFTRecipe, "dpo": DPORecipe}


def _inputs(cfg: RunConfig, recipe: str) -> tuple[str, Any, list[str], list[str]]:
    """(model path, tokenizer, train files, val files); the demo's made first when ``data.demo_task``."""
    from hybridrl.trainer.main import _data
    from hybridrl.trainer.preflight import load_run_tokenizer

    if not cfg.data.demo_task:
        return _data(cfg)
    from hybridrl.trainer.recipe_assets import make_recipe_demo

    out = os.path.join(cfg.trainer.default_local_dir, "demo")
    paths = [None]
    if dist.get_rank() == 0:
        paths = [make_recipe_demo(cfg, out, recipe)]
    dist.broadcast_object_list(paths, src=0)
    p = paths[0]
    tokenizer = load_run_tokenizer(p["tokenizer"], "the demo task's tokenizer")
    return cfg.model.path or p["model"], tokenizer, [p["train"]], [p["val"]]


def _datasets(cfg: RunConfig, recipe: str, tokenizer: Any, train: list[str], val: list[str]) -> tuple[Any, Any]:
    from hybridrl.data.recipe_data import PreferenceDataset, SFTDataset

    def make(files: list[str]) -> Any:
        if recipe == "sft":
            return SFTDataset(files, tokenizer, cfg.data, cfg.sft)
        return PreferenceDataset(files, tokenizer, cfg.data, cfg.dpo)

    return make(train), make(val) if val else None


def check_recipe_inputs(cfg: RunConfig, recipe: str) -> None:
    """What :func:`run` opens before its models, in one process without torch.distributed (``hybridrl
    validate-config --recipe R --inputs``): packages and run folder, the data files and their rows, the tokenizer,
    the local model folders, the checkpoint to resume and the LR schedule against the steps. The demo task makes
    its inputs in the run, so only the config is checked for it.

    Raises:
        InputError: the first bad input, in one line.
    """
    from hybridrl.config.checks_recipes import check_schedule
    from hybridrl.trainer.main import _data, resolve_total_steps
    from hybridrl.trainer.preflight import check_environment, check_model_folders, check_resume

    check_environment(cfg)
    if cfg.data.demo_task:
        if cfg.trainer.total_steps is not None:  # known without the data
            check_schedule(cfg)
        return
    model_path, tokenizer, train_files, val_files = _data(cfg)
    check_model_folders(cfg, model_path, tokenizer)
    check_resume(cfg, model_path)
    train_ds, _ = _datasets(cfg, recipe, tokenizer, train_files, val_files)
    resolve_total_steps(cfg, len(train_ds))
    check_schedule(cfg)


def run(recipe: str, config: str, overrides: list[str]) -> list[dict[str, float]]:
    """Run ``recipe`` ("sft" / "dpo") with ``config`` and ``overrides`` in this (already launched) process; returns
    the metric history."""
    from hybridrl.config import run_layout
    from hybridrl.config.checks_recipes import check_schedule, load_recipe_config
    from hybridrl.distributed import apply_collective_timeout, detect_env, init_distributed, init_model_parallel
    from hybridrl.trainer import startup
    from hybridrl.trainer.main import resolve_total_steps
    from hybridrl.trainer.offline import OfflineTrainer
    from hybridrl.trainer.preflight import check_environment, check_model_folders, check_resume

    start = time.perf_counter()
    penv = detect_env()
    cfg = load_recipe_config(recipe, config, overrides, world_size=penv.world_size)  # every check first
    check_environment(cfg)
    init_distributed(timeout_s=cfg.trainer.collective_timeout_s)
    layout = run_layout(cfg, penv.world_size)
    init_model_parallel(layout, seed=cfg.trainer.seed)
    model_path, tokenizer, train_files, val_files = _inputs(cfg, recipe)
    check_model_folders(cfg, model_path, tokenizer)
    check_resume(cfg, model_path)
    train_ds, val_ds = _datasets(cfg, recipe, tokenizer, train_files, val_files)  # bad rows: one line, no model yet
    resolve_total_steps(cfg, len(train_ds))
    check_schedule(cfg)
    if penv.rank == 0:
        val = f"; validation: {val_ds.summary()}" if val_ds is not None else ""
        print(f"[hybridrl] {recipe} run {cfg.trainer.project_name}/{cfg.trainer.experiment_name}: "
              f"{cfg.trainer.total_steps} steps, {layout.describe()}, outputs in {cfg.trainer.default_local_dir}; "
              f"train: {train_ds.summary()}{val}", flush=True)  # fmt: skip
    pool = ResourcePool(process_on_nodes=list(cfg.resources.process_on_nodes), use_gpu=torch.cuda.is_available(),
                        max_colocate_count=cfg.resources.max_colocate_count)  # fmt: skip
    trainer = OfflineTrainer(cfg, RECIPES[recipe](cfg, pool, model_path), train_ds, val_ds)
    apply_collective_timeout(cfg.trainer.collective_timeout_s)
    startup.start_training()  # the collector, paused through start-up, comes back (hybridrl.trainer.startup)
    history = trainer.fit()
    if penv.rank == 0:
        print(f"[hybridrl] {summary(cfg, recipe, history, time.perf_counter() - start)}", flush=True)
    return history


def summary(cfg: RunConfig, recipe: str, history: list[dict[str, float]], seconds: float) -> str:
    """The last line of a recipe run: what it achieved and where its checkpoint is, with the export command."""
    from hybridrl.trainer.checkpoint import newest_checkpoint
    from hybridrl.trainer.main import _first_last

    keys = ("val/sft/loss", "sft/loss") if recipe == "sft" else ("val/dpo/accuracy", "dpo/accuracy", "dpo/loss")
    achieved = "; ".join(filter(None, (_first_last(history, k) for k in keys))) or "no metrics"
    root = cfg.trainer.default_local_dir
    ckpt = newest_checkpoint(root) if os.path.isdir(root) else None
    where = f"no checkpoint (trainer.save_freq={cfg.trainer.save_freq})"
    if ckpt:
        export = f"torchrun --nproc-per-node 1 -m hybridrl export {ckpt} {os.path.join(root, 'hf_model')}"
        where = f"checkpoint {ckpt} (as an HF model: {export})"
    steps = sum(1 for h in history if "timing_s/step" in h)
    return f"done: {steps} {recipe} steps in {seconds:.0f} s; {achieved}; {where}"
