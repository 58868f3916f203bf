"""Config check of ``trainer.launcher``: SPMD (torchrun / srun) or the Ray single controller (docs/ray.md).

Ray mode runs the same loop and roles; what it does not do yet is refused here, in one line, before a Ray
cluster is contacted: writing checkpoints (``trainer.save_freq``) and resuming from one (``resume_mode=path``;
``auto`` is refused by the driver only when the run folder holds a checkpoint).
Run by :func:`hybridrl.config.checks.validate` (listed in its ``CHECKS``).
"""

from __future__ import annotations

from hybridrl.config.schema import ConfigError, RunConfig

LAUNCHERS = ("spmd", "ray")


def check_launcher(cfg: RunConfig, world: int) -> None:
    """``trainer.launcher`` is known, and a Ray run asks for nothing Ray mode lacks."""
    t = cfg.trainer
    if t.launcher not in LAUNCHERS:
        raise ConfigError(f"trainer.launcher ({t.launcher!r}) must be one of {LAUNCHERS}", key="trainer.launcher")
    if t.launcher != "ray":
        return
    if t.save_freq > 0:
        raise ConfigError(
            f"trainer.save_freq ({t.save_freq}): Ray mode does not write checkpoints yet; set trainer.save_freq=-1 "
            "or launch SPMD (trainer.launcher=spmd, under torchrun)",
            key="trainer.save_freq",
        )
    if t.resume_mode == "path":
        raise ConfigError(
            "trainer.resume_mode (path): Ray mode does not resume from checkpoints yet; set trainer.resume_mode="
            "disable or launch SPMD (trainer.launcher=spmd, under torchrun)",
            key="trainer.resume_mode",
        )
