"""Prompt sharing through the trainer: a 2-step GRPO run with ``actor.share_prompt_prefix`` true equals one with it
false (``hybridrl train`` under torchrun on 2 CPU ranks, the quickstart's GRPO config: TP2, 8 samples per prompt,
the reference feeding a KL loss, so old log-probs, reference log-probs and the update all run packed).

Every metric that does not measure time or memory is compared: losses, grad norms, KL, entropy, rewards and
lengths at step 2 come from weights updated at step 1, so they only agree if the packed update gave the unpacked
gradients. Each update is one micro-batch, so per-micro-batch metric means do not depend on how the rows are
grouped into micro-batches (sharing groups them by prompt, the unshared pass by length).
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
UNTIMED = ("timing_s/", "perf/", "reshard/seconds", "reshard/probe_s", "rollout/push_s")


def _train(out: Path, share: str) -> list[dict]:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "hybridrl", "train", "tiny_cpu_grpo.yaml"]
    cmd += [
        "trainer.total_steps=2",
        "trainer.test_freq=-1",
        "trainer.loggers=[jsonl]",
        f"trainer.default_local_dir={out}",
    ]
    cmd += ["data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=64"]
    cmd += ["actor.use_kl_loss=true", f"actor.share_prompt_prefix={share}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]


def test_grpo_metrics_equal_with_and_without_sharing(tmp_path):
    shared, unshared = _train(tmp_path / "shared", "true"), _train(tmp_path / "unshared", "false")
    assert [h["step"] for h in shared] == [h["step"] for h in unshared] == [1, 2]
    compared = 0
    for a, b in zip(shared, unshared, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            if key.startswith(UNTIMED) or not isinstance(a[key], float):
                continue
            assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-6), (a["step"], key, a[key], b[key])
            compared += 1
    assert compared > 40 and shared[1]["actor/kl_loss"] > 0  # the reference and the KL loss ran
    assert shared[0]["actor/param_norm"] != shared[1]["actor/param_norm"]  # step 1's update changed the weights
