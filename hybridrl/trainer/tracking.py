"""Metrics sinks and stage timers for the trainer (rank 0 writes; every rank may time).

``Tracker(loggers, log_dir, project, experiment, config)`` fans one ``log(metrics, step)`` call out to:

- ``console``: one compact line per step (a progress bar with ETA, then the key metrics);
- ``jsonl``: ``<log_dir>/metrics.jsonl``, one JSON object per step (the file tests and tools read). A run never
  empties an earlier history: what a new run or a resume would replace is kept as ``metrics.<k>.jsonl``;
- ``tensorboard``: ``<log_dir>/tensorboard`` event files (``torch.utils.tensorboard``);
- ``wandb``: only when the ``wandb`` package is installed (otherwise a one-line error naming the fix).

A checkpoint part: :meth:`Tracker.state_dict` is the step its history ends at; loading it on resume moves the
rows logged after that checkpoint out of ``metrics.jsonl`` (:meth:`Tracker.resumed_at`).

``StageTimer`` collects seconds per named stage of a step (``with timer("rollout"): ...``) as
``timing_s/<stage>`` metrics, the cores the process kept busy in it as ``perf/cpu_cores/<stage>`` and the pages it
touched anew in it as ``perf/page_faults/<stage>``.
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

VALID_LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
CONSOLE_KEYS = (
    "reward/mean",
    "val/reward/mean",
    "actor/pg_loss",
    "actor/kl",
    "actor/clipfrac",
    "actor/entropy",
    "critic/vf_loss",
    "sft/loss",
    "val/sft/loss",
    "dpo/loss",
    "dpo/accuracy",
    "val/dpo/accuracy",
    "response/length_mean",
    "perf/tokens_per_s",
    "timing_s/step",
)


class StageTimer:
    """Seconds per named stage, the cores this process kept busy in it (its CPU time, every thread's, over the
    stage's wall time: 2.0 on two cores is both busy, 1.0 one core or one waiting for the other half the time), and
    its minor page faults in it (memory touched for the first time since the kernel handed it over: a pass that
    re-allocates its tensors from fresh pages shows tens of thousands; see
    :func:`hybridrl.trainer.startup.keep_freed_memory`).

    ``metrics()`` returns ``{'timing_s/<stage>': seconds, 'perf/cpu_cores/<stage>': cores,
    'perf/page_faults/<stage>': faults}``.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}
        self.faults: dict[str, int] = {}

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start, cpu, faults = time.perf_counter(), time.process_time(), _minor_faults()
        try:
            yield
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start
            self.cpu_seconds[stage] = self.cpu_seconds.get(stage, 0.0) + time.process_time() - cpu
            self.faults[stage] = self.faults.get(stage, 0) + _minor_faults() - faults

    def metrics(self) -> dict[str, float]:
        cores = {f"perf/cpu_cores/{k}": self.cpu_seconds[k] / v for k, v in self.seconds.items() if v > 0}
        faults = {f"perf/page_faults/{k}": float(v) for k, v in self.faults.items()}
        return {**{f"timing_s/{k}": v for k, v in self.seconds.items()}, **cores, **faults}


def _minor_faults() -> int:
    """This process's minor page faults so far (every thread's)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _free_name(path: str) -> str:
    """``<stem>.<k><ext>`` next to ``path`` for the first k >= 1 not taken."""
    stem, ext = os.path.splitext(path)
    k = 1
    while os.path.exists(f"{stem}.{k}{ext}"):
        k += 1
    return f"{stem}.{k}{ext}"


def _scalar(value: Any) -> float | None:
    try:
        value = float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError):
        return None
    return value


class Tracker:
    """Writes step metrics to the configured sinks; a no-op on ranks other than 0."""

    def __init__(
        self,
        loggers: list[str],
        log_dir: str,
        project: str = "hybridrl",
        experiment: str = "run",
        config: Mapping[str, Any] | None = None,
        total_steps: int | None = None,
        rank: int = 0,
    ) -> None:
        unknown = [name for name in loggers if name not in VALID_LOGGERS]
        if unknown:
            raise ValueError(f"trainer.loggers has {unknown}; valid: {', '.join(VALID_LOGGERS)}")
        self.active = rank == 0
        self.loggers, self.log_dir, self.total_steps = list(loggers), log_dir, total_steps
        self._start, self._start_step = time.perf_counter(), 0
        self.last_step = 0  # the step logged last: where the history a checkpoint belongs to ends
        self._jsonl = self._tb = self._wandb = None
        if not self.active:
            return
        os.makedirs(log_dir, exist_ok=True)
        if "jsonl" in loggers:
            self._jsonl = open(os.path.join(log_dir, "metrics.jsonl"), "a", encoding="utf-8")  # noqa: SIM115
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(log_dir, "tensorboard"))
        if "wandb" in loggers:
            try:
                import wandb
            except ImportError:
                raise ValueError("trainer.loggers has 'wandb' but wandb is not installed; pip install wandb") from None
            self._wandb = wandb.init(project=project, name=experiment, config=dict(config or {}), dir=log_dir)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record ``metrics`` (scalars; others are skipped) for ``step``."""
        self.last_step = step
        if not self.active:
            return
        scalars = {k: v for k, v in ((k, _scalar(v)) for k, v in metrics.items()) if v is not None}
        if self._jsonl is not None:
            clean = {k: (v if math.isfinite(v) else str(v)) for k, v in scalars.items()}
            self._jsonl.write(json.dumps({"step": step, **clean}) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        if "console" in self.loggers:
            print(self._console_line(scalars, step), file=sys.stdout, flush=True)

    def _console_line(self, scalars: Mapping[str, float], step: int) -> str:
        parts = [f"step {step}"]
        if self.total_steps:
            done = min(step, self.total_steps) / self.total_steps
            ran = max(min(step, self.total_steps) - self._start_step, 0)  # steps of this launch
            left = self.total_steps - min(step, self.total_steps)
            elapsed = time.perf_counter() - self._start
            eta = elapsed / ran * left if ran else float("nan")
            bar = "#" * int(20 * done)
            parts = [f"[{bar:<20s}] {step}/{self.total_steps} eta {eta:5.0f}s"]
        parts += [
            f"{k.split('/')[-1] if k.count('/') == 1 else k}={scalars[k]:.4g}" for k in CONSOLE_KEYS if k in scalars
        ]
        return "  ".join(parts)

    def start_fresh(self) -> None:
        """A run that did not resume: an earlier run's ``metrics.jsonl`` in this folder is set aside whole as
        ``metrics.<k>.jsonl`` (k = 1, 2, ... in the order they are set aside), never emptied; one line says so."""
        if self._jsonl is None or os.path.getsize(self._jsonl.name) == 0:
            return
        path = self._jsonl.name
        self._jsonl.close()
        kept = _free_name(path)
        os.replace(path, kept)
        self._jsonl = open(path, "a", encoding="utf-8")  # noqa: SIM115
        print(f"[hybridrl] note: {path} of an earlier run in this folder is kept as {os.path.basename(kept)}; "
              "this run logs to a new one", flush=True)  # fmt: skip

    def resumed_at(self, step: int) -> None:
        """A run resumed from the checkpoint of ``step``. JSONL rows of later steps (logged after that checkpoint,
        before the crash; or past an older checkpoint resumed on purpose) leave ``metrics.jsonl``, since the
        resumed run logs those steps again: one row per step. Nothing is lost: the file as it was is first
        copied to ``metrics.<k>.jsonl`` (one line says so), and the new file replaces the old one atomically.
        The ETA counts from here."""
        self._start, self._start_step, self.last_step = time.perf_counter(), step, step
        if self._jsonl is None:
            return
        self._jsonl.flush()
        path = self._jsonl.name
        kept, later, cut = [], 0, 0
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    row = json.loads(line) if line.strip() else None
                except json.JSONDecodeError:  # a line cut by the crash (disk full, a killed writer)
                    cut += 1
                    continue
                if isinstance(row, dict) and row.get("step", 0) > step:
                    later += 1
                elif row is not None:
                    kept.append(line if line.endswith("\n") else line + "\n")
        if not (later or cut):
            return
        self._jsonl.close()
        copy = _free_name(path)
        shutil.copyfile(path, copy)  # first: a crash from here on loses nothing
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)
        self._jsonl = open(path, "a", encoding="utf-8")  # noqa: SIM115
        parts = [f"{later} row(s) past step {step} moved out (this run logs those steps again)"] if later else []
        parts += [f"dropped {cut} unreadable line(s) (cut by the crash)"] if cut else []
        print(f"[hybridrl] note: {path}: {'; '.join(parts)}; the file as it was is kept as "
              f"{os.path.basename(copy)}", flush=True)  # fmt: skip

    def state_dict(self) -> dict[str, int]:
        """``{"step"}``: the step logged last (a checkpoint is saved after its step's row)."""
        return {"step": self.last_step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume the history of a checkpoint saved after step ``state["step"]`` (:meth:`resumed_at`)."""
        self.resumed_at(int(state["step"]))

    def close(self) -> None:
        """Close the sinks; a closed tracker logs nothing more."""
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._jsonl = self._tb = self._wandb = None
