"""Ray mode against SPMD: the same run launched both ways, as users launch them, gives the same numbers.

Each test runs 2 steps of the tiny CPU config twice with the same seed: ``torchrun --nproc-per-node 2 -m hybridrl
train`` (SPMD) and ``python -m hybridrl train ... trainer.launcher=ray`` (one driver, a local Ray with 2 CPUs
started and stopped by it, 2 host actors). Every metric of metrics.jsonl but timings must agree within 1e-6:
losses, grad norms, rewards, KL, response lengths, the engine-vs-actor log-prob mismatch, the reshard counters.
Both modes build the same roles on the same Megatron groups and split every DataProto into the same DP chunks,
so on CPU (fp32, one thread per rank) they agree bit for bit.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.multirank
TOLERANCE = 1e-6
GRPO = ("algorithm.adv_estimator=grpo", "rollout.n=2", "critic.enable=false", "actor.use_kl_loss=true",
        "algorithm.use_kl_in_reward=false", "actor.ppo_mini_batch_size=4")  # fmt: skip


def launch(out: Path, mode: str, *overrides: str) -> list[dict]:
    """Run 2 steps of tiny_cpu.yaml in ``mode`` ("spmd" | "ray") through the command line; metrics.jsonl rows."""
    if mode == "spmd":
        cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "2"]
    else:
        cmd = [sys.executable]
    cmd += ["-m", "hybridrl", "train", "tiny_cpu.yaml", "trainer.total_steps=2", "trainer.loggers=[jsonl]",
            f"trainer.default_local_dir={out}", *overrides]  # fmt: skip
    if mode == "ray":
        cmd.append("trainer.launcher=ray")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local Ray of 2 CPUs, not a cluster
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]


def compared(row: dict) -> dict[str, float]:
    """The numbers of a metrics row that do not measure time or this process's memory."""
    return {k: v for k, v in row.items()
            if not (k.startswith(("timing_s/", "perf/")) or k.endswith(("_s", "/seconds")))}  # fmt: skip


def assert_same_run(spmd: list[dict], ray: list[dict]) -> None:
    assert [r["step"] for r in ray] == [r["step"] for r in spmd]
    for a, b in zip(spmd, ray, strict=True):
        a, b = compared(a), compared(b)
        assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
        worst = max(abs(a[k] - b[k]) for k in a)
        assert worst <= TOLERANCE, {k: (a[k], b[k]) for k in a if abs(a[k] - b[k]) > TOLERANCE}
    for key in ("actor/loss", "actor/grad_norm", "reward/mean"):
        assert all(math.isfinite(r[key]) for r in ray if r["step"] > 0), key
    assert ray[-1]["actor/param_norm"] != ray[-2]["actor/param_norm"]  # the updates moved the weights


def test_ppo_ray_equals_spmd(tmp_path):
    extra = ("trainer.test_freq=2",)  # validation before and after training, through the same groups
    spmd, ray = launch(tmp_path / "spmd", "spmd", *extra), launch(tmp_path / "ray", "ray", *extra)
    assert_same_run(spmd, ray)
    assert "critic/loss" in ray[-1] and "critic/grad_norm" in ray[-1] and "val/reward/mean" in ray[0]


def test_grpo_ray_equals_spmd(tmp_path):
    spmd, ray = launch(tmp_path / "spmd", "spmd", *GRPO), launch(tmp_path / "ray", "ray", *GRPO)
    assert_same_run(spmd, ray)
    assert "critic/loss" not in ray[-1] and "actor/kl_loss" in ray[-1]
