"""Ray mode against SPMD: the same run launched both ways, as users launch them, gives the same numbers.

Each test runs 2 steps of the tiny CPU config twice with the same seed: ``torchrun --nproc-per-node 2 -m hybridrl
train`` (SPMD) and ``python -m hybridrl train ... trainer.launcher=ray`` (one driver and 2 host actors, on a
running Ray of 2 CPUs at RAY_ADDRESS, or on a local one the driver starts and stops). Every metric of
metrics.jsonl but timings must agree within 1e-6: losses, grad norms, rewards, KL, response lengths, the
engine-vs-actor log-prob mismatch, the reshard counters.
Both modes build the same roles on the same Megatron groups and split every DataProto into the same DP chunks,
so on CPU (fp32, one thread per rank) they agree bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridrl.distributed.spawn import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.multirank
TOLERANCE = 1e-6
AUTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}  # as launch/slurm_ray.sh sets it up
GRPO = ("algorithm.adv_estimator=grpo", "rollout.n=2", "critic.enable=false", "actor.use_kl_loss=true",
        "algorithm.use_kl_in_reward=false", "actor.ppo_mini_batch_size=4")  # fmt: skip


@contextlib.contextmanager
def ray_cluster() -> Iterator[str]:
    """A running Ray cluster of 2 CPUs (``ray start --head --block``, stopped by its pid); yields its address."""
    port = free_port()
    cmd = [str(Path(sys.executable).with_name("ray")), "start", "--head", "--port", str(port), "--num-cpus", "2",
           "--include-dashboard", "false", "--disable-usage-stats", "--block"]  # fmt: skip
    env = {**os.environ, **AUTH}
    head = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:  # the head's GCS port answers
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(1)
        yield f"127.0.0.1:{port}"
    finally:
        os.killpg(head.pid, signal.SIGTERM)  # its own session: the head and the Ray processes it started
        head.wait(timeout=60)


def launch(out: Path, mode: str, *overrides: str, address: str | None = None) -> list[dict]:
    """Run 2 steps of tiny_cpu.yaml in ``mode`` ("spmd" | "ray") through the command line; metrics.jsonl rows.
    Ray mode joins the cluster at ``address`` (RAY_ADDRESS), else starts a local one."""
    if mode == "spmd":
        cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "2"]
    else:
        cmd = [sys.executable]
    cmd += ["-m", "hybridrl", "train", "tiny_cpu.yaml", "trainer.total_steps=2", "trainer.loggers=[jsonl]",
            f"trainer.default_local_dir={out}", *overrides]  # fmt: skip
    if mode == "ray":
        cmd.append("trainer.launcher=ray")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    if address is not None:
        env.update(RAY_ADDRESS=address, **AUTH)
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
    """On a running Ray cluster (RAY_ADDRESS): its actors get the driver's variables through Ray, not by birth."""
    extra = ("trainer.test_freq=2",)  # validation before and after training, through the same groups
    spmd = launch(tmp_path / "spmd", "spmd", *extra)
    with ray_cluster() as address:
        ray = launch(tmp_path / "ray", "ray", *extra, address=address)
    assert_same_run(spmd, ray)
    assert "critic/loss" in ray[-1] and "critic/grad_norm" in ray[-1] and "val/reward/mean" in ray[0]


def test_grpo_ray_equals_spmd(tmp_path):
    """On a local Ray the driver starts (2 CPUs here) and stops."""
    spmd, ray = launch(tmp_path / "spmd", "spmd", *GRPO), launch(tmp_path / "ray", "ray", *GRPO)
    assert_same_run(spmd, ray)
    assert "critic/loss" not in ray[-1] and "actor/kl_loss" in ray[-1]


def test_killed_actor_ends_the_run_naming_it(tmp_path):
    """A host actor SIGKILLed in the middle of step 1 (by the custom scorer, on the driver): the driver ends the
    run with exit 1 and one line naming the role, the rank and the node, well within the collective timeout."""
    stamp = tmp_path / "killed_at"
    cmd = [sys.executable, "-m", "hybridrl", "train", "tiny_cpu.yaml", "trainer.launcher=ray", "trainer.total_steps=2",
           f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.collective_timeout_s=120",
           f"reward.custom.path={Path(__file__).with_name('ray_kill_scorer.py')}",
           "reward.overlap_generation=false"]  # the scorer on the driver (overlap runs it on the hosts)  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(OMP_NUM_THREADS="1", RAY_KILL_AT_CALL="1", RAY_KILL_STAMP=str(stamp))
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    ended = time.time()
    assert result.returncode == 1, (result.stdout + result.stderr)[-4000:]
    line = next(x for x in result.stderr.splitlines() if x.startswith("worker error: "))
    assert "the actor worker's host rank 1 on node" in line and "died during compute_log_prob" in line, line
    assert ended - float(stamp.read_text()) < 120  # the driver did not wait for a collective timeout
