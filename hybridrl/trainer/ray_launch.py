"""``hybridrl train CONFIG trainer.launcher=ray``: the loop as one driver, each device a Ray actor (docs/ray.md).

    RAY_ADDRESS=head:6379 hybridrl train tiny_cpu.yaml trainer.launcher=ray    # a running cluster
    hybridrl train tiny_cpu.yaml trainer.launcher=ray                         # a local Ray, started and stopped

The driver does what rank 0 does under SPMD outside the roles: config and input checks, the demo assets, the
tokenizer and datasets, rewards, advantages, metrics. It joins (or starts) Ray, places one host actor per
device (:class:`~hybridrl.workers.ray_pool.RayResourcePool`, ``resources.process_on_nodes``), gives them
Megatron's groups of the run's layout and builds the same roles in them as SPMD does
(:func:`~hybridrl.trainer.rl_trainer.role_workers`), each behind a
:class:`~hybridrl.workers.ray_group.MegatronRayWorkerGroup`; then it runs the same :meth:`RLTrainer.fit`.
Collective helpers the driver's own code calls (the demo assets' barrier) run on a one-process gloo world
of the driver alone. A host that dies ends the run with one line naming its role, rank and node (exit 1).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from hybridrl.config import ConfigError, RunConfig, load_config, run_layout, to_yaml
from hybridrl.distributed import ParallelLayout

ROLE_SECTIONS = {"ActorRolloutWorker": "actor_rollout", "CriticWorker": "critic", "ReferenceWorker": "ref",
                 "RewardModelWorker": "reward.model"}  # fmt: skip
"""Worker class -> the config section its ``init_args`` keys belong to (``actor_rollout.backend``)."""
DEFAULT_CONFIG = "tiny_cpu.yaml"
"""The run a bare :class:`RayResourcePool` serves (no ``config=``): the demo task, so the founding snippet runs."""


def driver_world() -> bool:
    """A one-process gloo world for the driver's own collective helpers (not the hosts' world); True when this call
    made it."""
    import torch.distributed as dist

    from hybridrl.distributed.env import free_port

    if dist.is_initialized():
        return False
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=600))  # fmt: skip
    return True


def _absolute(path: str | None, files: bool = False) -> str | None:
    """A local folder (``files``: or file) as an absolute path (the actors' working folder may differ from the
    driver's)."""
    exists = path is not None and (os.path.isdir(path) or (files and os.path.isfile(path)))
    return os.path.abspath(path) if exists else path


@dataclass
class RayRun:
    """What the pool's groups build their roles from: the resolved config, layout, model folder and tokenizer."""

    cfg: RunConfig
    layout: ParallelLayout
    model_path: str
    tokenizer: Any
    owns_world: bool = False  # the driver's one-process world was made for this run (closed with it)

    @property
    def timeout_s(self) -> float:
        return self.cfg.trainer.collective_timeout_s

    @property
    def seed(self) -> int:
        return self.cfg.trainer.seed

    @classmethod
    def prepare(cls, cfg: RunConfig) -> tuple[RayRun, Any, Any]:
        """The run of ``cfg`` (demo assets made, folders checked, ``trainer.total_steps`` resolved) and its
        training / validation datasets, as :func:`hybridrl.trainer.main.train` makes them on every rank."""
        from hybridrl.data import RLHFDataset
        from hybridrl.trainer.main import _data, resolve_rl_steps
        from hybridrl.trainer.preflight import check_model_folders, check_resume, check_rollout_family

        owns_world = driver_world()
        world = sum(cfg.resources.process_on_nodes or [cfg.trainer.n_gpus_per_node] * cfg.trainer.nnodes)
        layout = run_layout(cfg, world)
        cfg.trainer.default_local_dir = os.path.abspath(cfg.trainer.default_local_dir)
        model_path, tokenizer, train_files, val_files = _data(cfg)
        model_path = _absolute(model_path)
        cfg.model.path, cfg.critic.model_path = _absolute(cfg.model.path), _absolute(cfg.critic.model_path)
        cfg.reward.model.path = _absolute(cfg.reward.model.path)
        # files the hosts load again: the custom scorer (reward.overlap_generation) and the agent environment
        cfg.reward.custom.path = _absolute(cfg.reward.custom.path, files=True)
        cfg.rollout.agent.path = _absolute(cfg.rollout.agent.path, files=True)
        check_model_folders(cfg, model_path, tokenizer)
        check_rollout_family(model_path, cfg.rollout.expert_parallel)
        check_resume(cfg, model_path)
        train_ds = RLHFDataset(train_files, tokenizer, cfg.data)
        val_ds = RLHFDataset(val_files, tokenizer, cfg.data) if val_files else None
        resolve_rl_steps(cfg, len(train_ds))
        return cls(cfg, layout, model_path, tokenizer, owns_world), train_ds, val_ds

    def close(self) -> None:
        """Close the driver's one-process world if this run made it."""
        import torch.distributed as dist

        if self.owns_world and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_world = False

    @classmethod
    def for_pool(cls, pool: Any) -> RayRun:
        """The run of ``pool.config`` (a RunConfig, or a config name; None: :data:`DEFAULT_CONFIG`) on the pool's
        processes."""
        if isinstance(pool.config, RunConfig):
            return cls.prepare(pool.config)[0]
        nodes = pool.process_on_nodes
        fit = [f"trainer.nnodes={len(nodes)}", f"trainer.n_gpus_per_node={max(nodes)}",
               f"resources.process_on_nodes={json.dumps(nodes)}", "trainer.launcher=ray"]  # fmt: skip
        return cls.prepare(load_config(pool.config or DEFAULT_CONFIG, fit))[0]

    def role_args(self, worker_cls: type, config_keys: dict[str, Any], missing: str) -> Any:
        """The :class:`~hybridrl.workers.group.ClassWithInitArgs` the trainer would build ``worker_cls`` from, with
        ``config_keys`` set in its section (``{"backend": "vllm"}`` -> ``actor_rollout.backend=vllm``)."""
        from hybridrl.trainer.rl_trainer import role_workers
        from hybridrl.workers.ray_group import WorkerClassError

        name = worker_cls.__name__
        cfg = self.cfg
        if config_keys:
            section = ROLE_SECTIONS.get(name)
            if section is None:
                raise WorkerClassError(f"RayClassWithInitArgs({name}): {missing}; give every constructor argument")
            sets = [f"{section}.{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in config_keys.items()]
            with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
                f.write(to_yaml(cfg))
            try:
                cfg = load_config(f.name, sets)
            finally:
                os.unlink(f.name)
        for spec in role_workers(cfg, self.layout, self.model_path, self.tokenizer).values():
            if spec.cls is worker_cls:
                return spec
        raise WorkerClassError(
            f"RayClassWithInitArgs({name}): {missing}, and the pool's run config does not enable that role; give "
            "every constructor argument or enable the role (e.g. critic.enable=true) in RayResourcePool(config=...)"
        )


def pool_for(cfg: RunConfig) -> Any:
    """The run's :class:`RayResourcePool`: ``resources.process_on_nodes`` (default nnodes x n_gpus_per_node), GPUs
    when the cluster has any."""
    from hybridrl.workers.ray_pool import RayResourcePool, import_ray

    nodes = list(cfg.resources.process_on_nodes or [cfg.trainer.n_gpus_per_node] * cfg.trainer.nnodes)
    use_gpu = import_ray().cluster_resources().get("GPU", 0) > 0
    return RayResourcePool(nodes, use_gpu=use_gpu, max_colocate_count=cfg.resources.max_colocate_count)


def train_ray(config: str, overrides: list[str]) -> list[dict[str, float]]:
    """Run ``config`` in Ray mode from this (driver) process; returns the metric history."""
    from hybridrl.rewards import RewardManager
    from hybridrl.trainer.checkpoint import newest_checkpoint
    from hybridrl.trainer.main import check_reward_sources, data_summary, run_summary, start_summary
    from hybridrl.trainer.preflight import check_environment
    from hybridrl.trainer.rl_trainer import RLTrainer
    from hybridrl.workers.ray_group import WorkerDiedError
    from hybridrl.workers.ray_pool import connect, import_ray

    start = time.perf_counter()
    import_ray()  # a missing Ray is named before anything else
    cfg = load_config(config, overrides)  # world = the pool: nnodes x n_gpus_per_node (or process_on_nodes)
    check_environment(cfg)
    root = cfg.trainer.default_local_dir
    if cfg.trainer.resume_mode == "auto" and os.path.isdir(root) and newest_checkpoint(root):
        raise ConfigError(f"trainer.resume_mode (auto) would resume {newest_checkpoint(root)}: Ray mode does not "
                          "resume yet; set trainer.resume_mode=disable or another trainer.default_local_dir",
                          key="trainer.resume_mode")  # fmt: skip
    reward = RewardManager.from_config(cfg.reward)
    world = sum(cfg.resources.process_on_nodes or [cfg.trainer.n_gpus_per_node] * cfg.trainer.nnodes)
    started = connect(num_cpus=max(world, os.cpu_count() or 1))
    pool = None
    try:
        pool = pool_for(cfg)  # the pool's request vs the cluster: before any actor
        run, train_ds, val_ds = RayRun.prepare(cfg)
        check_reward_sources(reward, train_ds, val_ds)
        pool.run = run
        print(f"[hybridrl] {start_summary(cfg, run.layout)}; Ray mode, {world} actors; "
              f"{data_summary(cfg, train_ds, val_ds)}", flush=True)  # fmt: skip
        trainer = RLTrainer(cfg, run.layout, run.model_path, run.tokenizer, train_ds, val_ds, reward, ray_pool=pool)
        history = trainer.fit()
        print(f"[hybridrl] {run_summary(cfg, history, time.perf_counter() - start)}", flush=True)
        return history
    except WorkerDiedError as err:
        print(f"worker error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        if pool is not None:
            pool.shutdown()
        if started and import_ray().is_initialized():
            import_ray().shutdown()
