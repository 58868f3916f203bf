"""``hybridrl train CONFIG [key=value ...]``: one PPO/GRPO run, launched by torchrun or srun (SPMD).

    torchrun --nproc-per-node 2 -m hybridrl train tiny_cpu.yaml algorithm.adv_estimator=grpo

Order: launch environment -> config (every check) -> packages, run folder and scorer
(:mod:`hybridrl.trainer.preflight`) -> Megatron groups -> data, tokenizer and model folders (the demo task's when
``data.demo_task``) -> role workers -> ``fit()`` -> one summary line. Every input is checked before the first
model is built; the command line (:mod:`hybridrl.cli`) turns their errors into one line.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import shutil
import time
from typing import Any

import torch.distributed as dist

from hybridrl.config import ConfigError, RunConfig, load_config, run_layout
from hybridrl.distributed import (
    LaunchError,
    ParallelLayout,
    detect_env,
    end_distributed,
    init_distributed,
    init_model_parallel,
)
from hybridrl.trainer import startup
from hybridrl.trainer.preflight import (
    ModelPathError,
    check_environment,
    check_model_folders,
    check_resume,
    check_rollout_device,
    check_rollout_family,
    load_run_tokenizer,
)


def _data(cfg: RunConfig) -> tuple[str, Any, list[str], list[str]]:
    """(model path, tokenizer, train files, val files); makes the demo assets first when asked."""
    from hybridrl.rollout.vllm_engine import stop_string_tokenizer

    if cfg.data.demo_task:
        from hybridrl.trainer.demo_assets import make_demo_assets

        out = os.path.join(cfg.trainer.default_local_dir, "demo")
        if dist.get_rank() == 0:
            make_demo_assets(cfg, out)
        dist.barrier()
        tokenizer = load_run_tokenizer(os.path.join(out, "tokenizer.model"), "the demo task's tokenizer")
        stop_string_tokenizer(list(cfg.rollout.stop), tokenizer)
        model_path = cfg.model.path or os.path.join(out, "model")
        return model_path, tokenizer, [os.path.join(out, "train.parquet")], [os.path.join(out, "val.parquet")]
    # model.path is set here: the config checks refuse demo_task=false without it
    cfg.model.path = resolve_checkpoint(cfg.model.path, "model.path")
    overridden = os.path.join(cfg.trainer.default_local_dir, "model_with_overrides")
    cfg.model.path = apply_architecture_overrides(cfg.model.architecture, cfg.model.path, overridden)
    if cfg.model.tokenizer_path is not None:
        cfg.model.tokenizer_path = resolve_checkpoint(cfg.model.tokenizer_path, "model.tokenizer_path", files=True)
    if cfg.critic.model_path is not None:
        cfg.critic.model_path = resolve_checkpoint(cfg.critic.model_path, "critic.model_path")
    if cfg.reward.model.enable and cfg.reward.model.path is not None:
        cfg.reward.model.path = resolve_checkpoint(cfg.reward.model.path, "reward.model.path")
    key = "model.tokenizer_path" if cfg.model.tokenizer_path is not None else "model.path"
    tokenizer = load_run_tokenizer(cfg.model.tokenizer_path or cfg.model.path, key)
    stop_string_tokenizer(list(cfg.rollout.stop), tokenizer)  # fails now, not after the models are built
    return cfg.model.path, tokenizer, list(cfg.data.train_files), list(cfg.data.val_files)


def apply_architecture_overrides(architecture: Any, path: str, out: str) -> str:
    """``model.architecture`` fields given next to a ``model.path`` override its config.json: a folder ``out``
    holding the edited config.json and links to every other file of ``path`` (weights are not copied) is
    made by rank 0 and returned; ``path`` itself when nothing differs. A field that shapes the weights is
    refused by the config checks for a local ``model.path`` (``checks_model.check_against_checkpoint``); for a
    Hub name, known only once downloaded, the loader's one-line error at load names the tensor."""
    wanted = {k: v for k, v in dataclasses.asdict(architecture).items() if v is not None}
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    rope = config.get("rope_parameters")
    if "rope_theta" in wanted and isinstance(rope, dict):  # transformers 5 keeps the RoPE base in rope_parameters
        theta = wanted.pop("rope_theta")
        if rope.get("rope_theta") != theta:
            wanted["rope_parameters"] = {**rope, "rope_theta": theta}
    changed = {k: v for k, v in wanted.items() if config.get(k) != v}
    if not changed:
        return path
    if not dist.is_initialized() or dist.get_rank() == 0:
        tmp = out + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        for name in os.listdir(path):
            if name != "config.json":
                os.symlink(os.path.abspath(os.path.join(path, name)), os.path.join(tmp, name))
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump({**config, **changed}, f, indent=2)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
        print(f"[hybridrl] model.architecture overrides {sorted(changed)} of {path}: using {out}", flush=True)
    if dist.is_initialized():
        dist.barrier()
    return out


HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "tokenizer*"]


def resolve_checkpoint(path: str, key: str, files: bool = False) -> str:
    """A local folder as is; a Hugging Face Hub name (``org/name``, no such folder here) is downloaded once per
    node (by its local rank 0: caches are often node-local; on a shared one the hub's file locks serialise
    them), the other ranks then read their node's cache, and the snapshot folder is returned. Collective when
    it downloads, over a gloo group without the run's collective timeout (a first download of a 70B checkpoint
    outlasts it). ``files``: a local file is taken as is too (a sentencepiece ``tokenizer.model``). Errors name
    the key and the fix in one line."""
    here = os.path.isdir(path) or (files and os.path.isfile(path))
    if dist.is_initialized():  # every rank takes the same branch below (the download is collective)
        seen: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(seen, here)
        if len(set(seen)) > 1:
            missing = [r for r, s in enumerate(seen) if not s]
            raise ModelPathError(
                f"{key} ({path!r}) is a folder on some nodes only (missing on ranks {missing[:8]}); put it on a "
                "filesystem every node sees"
            )
    if here:
        return path
    if not HUB_NAME.fullmatch(path):
        what = "a file, not a folder" if os.path.exists(path) else "not a folder"
        raise ModelPathError(f"{key} ({path!r}) is {what}; set it to a local Hugging Face model folder")
    from huggingface_hub import snapshot_download

    def fetch(offline: bool) -> str:
        return snapshot_download(repo_id=path, allow_patterns=HUB_FILES, local_files_only=offline)

    error: str | None = None
    if detect_env().local_rank == 0:
        try:
            fetch(offline=False)
        except Exception as exc:  # offline, unknown repo, gated model, no disk: all end the same way
            error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    if dist.is_initialized():
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=1))
        errors: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error, group=group)
        dist.destroy_process_group(group)
        error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise ModelPathError(
            f"{key} ({path!r}) is not a local folder and downloading it from the Hugging Face Hub failed "
            f"({error}); download it first (huggingface-cli download {path} --local-dir DIR) and set {key}=DIR"
        )
    return fetch(offline=True)


def check_reward_sources(reward: Any, train_ds: Any, val_ds: Any | None) -> None:
    """Every data_source of the training AND validation data has a scorer (an unknown validation source would
    otherwise score 0 on every sample, silently, each validation)."""
    if reward is not None:
        for dataset in [train_ds] if val_ds is None else [train_ds, val_ds]:
            reward.check_data_sources(dataset.data_sources, dataset.without_ground_truth)


def data_summary(cfg: RunConfig, train_ds: Any, val_ds: Any | None) -> str:
    """The start-up line about the data: rows kept, dropped and truncated per set, and the prompts each epoch
    leaves out because data.train_batch_size does not divide the training set."""
    out = f"train: {train_ds.summary()}"
    left_out = len(train_ds) % cfg.data.train_batch_size
    if left_out:
        which = "a different set each epoch" if cfg.data.shuffle else "the same last rows every epoch: never trained on"
        out += (f"; {left_out} left out per epoch ({which}; data.train_batch_size={cfg.data.train_batch_size} "
                f"does not divide {len(train_ds)})")  # fmt: skip
    if val_ds is not None:
        out += f"; validation: {val_ds.summary()}"
    return out


def resolve_total_steps(cfg: RunConfig, num_prompts: int) -> int:
    """``trainer.total_steps``; None in the config = ``total_epochs`` x full batches per epoch (set in place).

    Raises:
        ConfigError: ``data.train_batch_size`` exceeds the dataset (not one full batch per epoch).
    """
    per_epoch = num_prompts // cfg.data.train_batch_size
    if per_epoch < 1:
        raise ConfigError(
            f"data.train_batch_size ({cfg.data.train_batch_size}) is larger than the dataset ({num_prompts} "
            f"prompts); lower it or add data",
            key="data.train_batch_size",
        )
    if cfg.trainer.total_steps is None:
        cfg.trainer.total_steps = cfg.trainer.total_epochs * per_epoch
    return cfg.trainer.total_steps


def resolve_rl_steps(cfg: RunConfig, num_prompts: int) -> int:
    """:func:`resolve_total_steps` for an RL run, then its roles' LR schedules against their optimizer updates
    (a warmup as long as a decaying schedule is a config error here, not a traceback in the first update)."""
    from hybridrl.config.checks import optimizer_steps
    from hybridrl.config.checks_recipes import check_schedule

    total = resolve_total_steps(cfg, num_prompts)
    roles = ["actor", "critic"] if cfg.critic.enable else ["actor"]
    check_schedule(cfg, {role: optimizer_steps(cfg, role) for role in roles})
    return total


def train(config: str, overrides: list[str]) -> list[dict[str, float]]:
    """Run ``config`` with ``overrides`` in this (already launched) process; returns the metric history."""
    from hybridrl.rewards import RewardManager

    start = time.perf_counter()
    penv = detect_env()
    if penv.launcher == "single" and load_config(config, overrides).trainer.launcher == "ray":
        from hybridrl.trainer.ray_launch import train_ray

        startup.start_training()  # the driver's loop runs from here on: the collector comes back
        return train_ray(config, overrides)  # one driver; the devices are Ray actors
    cfg = load_config(config, overrides, world_size=penv.world_size)  # every check before any collective
    if cfg.trainer.launcher == "ray":
        raise LaunchError(f"trainer.launcher=ray runs one driver process, but this is rank {penv.rank} of a "
                          f"{penv.launcher} launch; run 'hybridrl train ...' without torchrun / srun")  # fmt: skip
    check_environment(cfg)  # the loggers' packages, a writable run folder
    reward = RewardManager.from_config(cfg.reward)  # the scorer loads and takes its four arguments; None: RM only
    init_distributed(timeout_s=cfg.trainer.collective_timeout_s)
    layout = run_layout(cfg, penv.world_size)  # the run's one layout: Megatron's groups, vLLM's, every role's
    init_model_parallel(layout, seed=cfg.trainer.seed)

    from hybridrl.data import RLHFDataset
    from hybridrl.distributed import apply_collective_timeout
    from hybridrl.trainer.rl_trainer import RLTrainer

    model_path, tokenizer, train_files, val_files = _data(cfg)
    check_model_folders(cfg, model_path, tokenizer)  # config.json, safetensors headers, tokenizer vs vocab
    check_rollout_family(model_path, cfg.rollout.expert_parallel)  # a family the weight switch maps into vLLM
    check_rollout_device(cfg)
    check_resume(cfg, model_path)  # the checkpoint to resume holds models of this shape
    train_ds = RLHFDataset(train_files, tokenizer, cfg.data)  # bad data: DataError, one line (file, row, fix)
    val_ds = RLHFDataset(val_files, tokenizer, cfg.data) if val_files else None
    check_reward_sources(reward, train_ds, val_ds)
    resolve_rl_steps(cfg, len(train_ds))
    if penv.rank == 0:
        print(f"[hybridrl] {start_summary(cfg, layout)}; {data_summary(cfg, train_ds, val_ds)}", flush=True)
    trainer = RLTrainer(cfg, layout, model_path, tokenizer, train_ds, val_ds, reward)
    apply_collective_timeout(cfg.trainer.collective_timeout_s)  # the groups vLLM and the workers made too
    startup.start_training()  # the collector, paused through start-up, comes back (hybridrl.trainer.startup)
    history = trainer.fit()
    if penv.rank == 0:
        print(f"[hybridrl] {run_summary(cfg, history, time.perf_counter() - start)}", flush=True)
    return history


def start_summary(cfg: RunConfig, layout: ParallelLayout) -> str:
    """The first line of a run: what runs where, and the folder its outputs go to."""
    t = cfg.trainer
    return (
        f"{cfg.algorithm.adv_estimator} run {t.project_name}/{t.experiment_name}: {t.total_steps} steps, "
        f"{layout.describe()}, {layout.describe_rollout()}, outputs in {t.default_local_dir}"
    )


def _first_last(history: list[dict[str, float]], key: str) -> str | None:
    values = [h[key] for h in history if key in h]
    return f"{key} {values[0]:.3f} -> {values[-1]:.3f}" if values else None


def run_summary(cfg: RunConfig, history: list[dict[str, float]], seconds: float) -> str:
    """The last line of a run: what it achieved (validation reward first -> last, else the training reward) and
    where its metrics and newest checkpoint are, with the command that exports that checkpoint as an HF folder."""
    from hybridrl.trainer.checkpoint import newest_checkpoint

    t = cfg.trainer
    steps = sum(1 for h in history if "timing_s/step" in h)
    achieved = _first_last(history, "val/reward/mean") or _first_last(history, "reward/mean") or "no metrics"
    where = []
    if "jsonl" in t.loggers:
        where.append(f"metrics {os.path.join(t.default_local_dir, 'logs', 'metrics.jsonl')}")
    if "tensorboard" in t.loggers:
        where.append(f"tensorboard {os.path.join(t.default_local_dir, 'logs', 'tensorboard')}")
    ckpt = newest_checkpoint(t.default_local_dir) if os.path.isdir(t.default_local_dir) else None
    if ckpt:
        where.append(f"checkpoint {ckpt} (as an HF model: torchrun --nproc-per-node 1 -m hybridrl export {ckpt} "
                     f"{os.path.join(t.default_local_dir, 'hf_model')})")  # fmt: skip
    else:
        where.append(f"no checkpoint (trainer.save_freq={t.save_freq})")
    return f"done: {steps} steps in {seconds:.0f} s; {achieved}; " + "; ".join(where)


def export(checkpoint: str, out: str, role: str = "actor", tp: int = 1, pp: int = 1) -> None:
    """Write ``role`` of the trainer checkpoint folder ``checkpoint`` (``global_step_N``) as an HF folder ``out``.

    Collective, in an already launched process: any ``tp`` x ``pp`` whose product divides the world size
    (the model is rebuilt from the checkpoint's own config.json; no run config is needed).
    """
    role_dir = os.path.join(checkpoint, role)
    if os.path.isdir(os.path.join(role_dir, "state")):  # an FSDP critic (hybridrl.fsdp.checkpoint): one process
        from hybridrl.fsdp.checkpoint import export_role

        if detect_env().rank == 0:
            export_role(role_dir, out)
            print(f"[hybridrl] exported {role} of {checkpoint} to {out}", flush=True)
        return
    penv = init_distributed()
    init_model_parallel(ParallelLayout.from_world(penv.world_size, tp=tp, pp=pp), seed=0)
    from hybridrl.mcore import lora_peft
    from hybridrl.mcore.checkpoint import build_from_checkpoint

    if not os.path.isdir(os.path.join(role_dir, "model")):
        from hybridrl.trainer.checkpoint import newest_checkpoint

        newest = newest_checkpoint(checkpoint)  # a run folder (trainer.default_local_dir) instead of a step
        hint = f"; it holds checkpoints: the newest is {newest}" if newest else ""
        raise ModelPathError(f"{role_dir}/model not found; pass a global_step_N folder holding the {role}{hint}")
    model = build_from_checkpoint(role_dir, role)
    model.export(out)  # LoRA adapters merged into the weights
    adapter = lora_peft.export_role(model, os.path.join(out, lora_peft.ADAPTER_DIR))  # and as a PEFT folder
    if penv.rank == 0:
        also = f" (LoRA adapter: {adapter})" if adapter else ""
        print(f"[hybridrl] exported {role} of {checkpoint} to {out}{also}", flush=True)
    end_distributed()  # every rank is done writing before any exits, and the groups go down cleanly
