"""The loop skeleton of the offline recipes (SFT, DPO): steps over a fixed dataset, validation, checkpoints.

    loader batch -> recipe.train_step(batch) -> [validation every trainer.test_freq] -> metrics -> checkpoint

A recipe (:mod:`hybridrl.trainer.recipes`) owns its worker groups and says what one step and one validation pass
do; this loop owns what every offline run shares with the RL trainer, through the same parts: the seeded,
resumable :class:`~hybridrl.data.loader.PromptLoader` over the dataset (``data.train_batch_size`` examples or pairs
per step, ``data.shuffle``, epochs from ``trainer.total_epochs`` when ``trainer.total_steps`` is null), the
:class:`~hybridrl.trainer.checkpoint.CheckpointManager` (its parts: the loader, the recipe's trained roles, the
loop's counters, the tracker; a resume under the same layout continues bit-exactly), the
:class:`~hybridrl.trainer.tracking.Tracker` sinks, and ``trainer.max_bad_steps``. Every process runs it (SPMD);
rank 0 writes metrics.
"""

from __future__ import annotations

import os
import time
from typing import Any, Protocol

import torch.distributed as dist

from hybridrl.config import RunConfig
from hybridrl.data.loader import PromptLoader
from hybridrl.protocol import DataProto
from hybridrl.trainer.checkpoint import CheckpointManager
from hybridrl.trainer.rl_trainer import TrainingStoppedError
from hybridrl.trainer.tracking import Tracker


class Recipe(Protocol):
    """What the loop needs from a recipe."""

    name: str
    """"sft" / "dpo": the prefix of its metrics (``sft/loss``, ``val/dpo/accuracy``)."""

    def parts(self) -> dict[str, Any]:
        """Its checkpoint parts by name (the trained roles' worker groups)."""
        ...

    def train_step(self, batch: DataProto) -> dict[str, float]:
        """One optimizer step on ``batch`` (a loader batch); its metrics, ``<name>/skipped`` > 0 if skipped."""
        ...

    def validate(self, batches: list[DataProto]) -> dict[str, float]:
        """Metrics over the whole validation set (``val/<name>/...``)."""
        ...


class OfflineTrainer:
    """Runs a :class:`Recipe` over ``train_dataset`` for ``trainer.total_steps`` steps.

    Args:
        cfg: a resolved run config with ``trainer.total_steps`` set.
        recipe: the recipe, its worker groups built.
        train_dataset / val_dataset: datasets with ``__len__`` and ``batch(indices) -> DataProto`` (val may be None).
    """

    def __init__(self, cfg: RunConfig, recipe: Recipe, train_dataset: Any, val_dataset: Any = None) -> None:
        self.cfg, self.recipe, self.val_dataset = cfg, recipe, val_dataset
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        t = cfg.trainer
        self.loader = PromptLoader(train_dataset, cfg.data.train_batch_size, shuffle=cfg.data.shuffle,
                                   seed=cfg.data.seed)  # fmt: skip
        self.tracker = Tracker(t.loggers, os.path.join(t.default_local_dir, "logs"), t.project_name,
                               t.experiment_name, total_steps=t.total_steps, rank=self.rank)  # fmt: skip
        self.step, self.bad_steps = 0, 0
        self._batches: Any = None
        # load order as in the RL trainer: the loader first (it refuses another data order), the tracker last
        states = {"loader": self.loader, **recipe.parts(), "trainer": self, "tracker": self.tracker}
        self.ckpt = CheckpointManager(t, states=states)
        if not self.ckpt.maybe_resume():
            self.tracker.start_fresh()

    def state_dict(self) -> dict[str, int]:
        """The loop's counters (a checkpoint part): steps done, skipped steps in a row."""
        return {"step": self.step, "bad_steps": self.bad_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.bad_steps = int(state["step"]), int(state.get("bad_steps", 0))

    def _next_batch(self) -> DataProto:
        if self._batches is None:
            self._batches = iter(self.loader)
        try:
            return next(self._batches)
        except StopIteration:  # a new epoch
            self._batches = iter(self.loader)
            return next(self._batches)

    def validate(self) -> dict[str, float]:
        """The recipe's validation over the whole validation set, ``data.val_batch_size`` rows at a time."""
        if self.val_dataset is None:
            return {}
        n = len(self.val_dataset)
        size = self.cfg.data.val_batch_size or n
        return self.recipe.validate([self.val_dataset.batch(range(s, min(s + size, n))) for s in range(0, n, size)])

    def fit(self) -> list[dict[str, float]]:
        """Train for ``trainer.total_steps`` steps; validate every ``trainer.test_freq`` (and before / at the end)."""
        t, history = self.cfg.trainer, []
        validating = t.test_freq > 0 and self.val_dataset is not None
        if validating and t.val_before_train:
            first = self.validate()
            self.tracker.log(first, step=self.step)
            history.append(first)
        while self.step < t.total_steps:
            batch = self._next_batch()
            self.step += 1
            start = time.perf_counter()
            metrics = self.recipe.train_step(batch)
            metrics["timing_s/step"] = time.perf_counter() - start
            metrics["train/epoch"] = float(batch.meta_info.get("epoch", 0))
            if validating and (self.step % t.test_freq == 0 or self.step == t.total_steps):
                metrics.update(self.validate())
            self.tracker.log(metrics, step=self.step)
            history.append(metrics)
            stop = self._count_bad_steps(metrics)  # before the save: the checkpoint holds this step's count
            saved = self.ckpt.maybe_save(self.step)
            if stop:
                path = saved or self.ckpt.save(self.step)
                self.tracker.close()
                raise TrainingStoppedError(
                    f"trainer.max_bad_steps ({t.max_bad_steps}) consecutive steps had NaN/Inf losses or grad norms; "
                    f"stopped at step {self.step} with a checkpoint in {path}; lower actor.optim.lr or check the data"
                )
        self.tracker.close()
        return history

    def _count_bad_steps(self, metrics: dict[str, float]) -> bool:
        skipped = metrics.get(f"{self.recipe.name}/skipped", 0.0) > 0
        self.bad_steps = self.bad_steps + 1 if skipped else 0
        if skipped and self.rank == 0:
            print(f"[hybridrl] warning: step {self.step} skipped its update (NaN/Inf loss or grad norm); "
                  f"{self.bad_steps}/{self.cfg.trainer.max_bad_steps} in a row", flush=True)  # fmt: skip
        return skipped and self.bad_steps >= self.cfg.trainer.max_bad_steps
