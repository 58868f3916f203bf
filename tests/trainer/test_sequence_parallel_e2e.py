"""Sequence parallelism on CPU end to end: ``hybridrl train tiny_cpu_grpo.yaml`` (the quickstart's config, TP2 on
2 CPU ranks) under torchrun as a user runs it, with ``actor.megatron.sequence_parallel`` true and false.

Sequence parallelism splits the norms and residual adds of each layer over the two TP ranks and replaces the
all-reduces by all-gathers and reduce-scatters along the sequence; it changes no number beyond float rounding.
The two runs sample the same responses (vLLM gets the same weights up to rounding), so every step's loss, grad
norm, entropy, KL and reward agree within fp32 tolerance, and the rollout stays in step with the actor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.multirank
KEYS = ("actor/loss", "actor/grad_norm", "actor/entropy", "actor/approx_kl", "actor/param_norm", "reward/mean")


def _train(out: Path, sequence_parallel: bool) -> list[dict]:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "hybridrl", "train", "tiny_cpu_grpo.yaml"]
    cmd += ["trainer.total_steps=3", "trainer.test_freq=-1", "trainer.loggers=[jsonl]", "data.train_batch_size=8",
            f"trainer.default_local_dir={out}",
            f"actor.megatron.sequence_parallel={str(sequence_parallel).lower()}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    lines = (out / "logs" / "metrics.jsonl").read_text().splitlines()
    return [h for h in map(json.loads, lines) if h["step"] > 0]


def test_sequence_parallel_run_equals_the_plain_tp_run(tmp_path):
    plain, sp = _train(tmp_path / "plain", False), _train(tmp_path / "sp", True)
    assert [h["step"] for h in sp] == [h["step"] for h in plain] == [1, 2, 3]
    for a, b in zip(plain, sp, strict=True):
        for key in KEYS:
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), (a["step"], key, a[key], b[key])
        assert b["rollout/logprob_mismatch"] < 1e-4, b["rollout/logprob_mismatch"]
    assert sp[0]["actor/param_norm"] != sp[-1]["actor/param_norm"]  # it trained
