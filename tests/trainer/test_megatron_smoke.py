"""The quickstart's job through a real torchrun launch on 2 CPU ranks (torchrun env -> gloo -> Megatron TP=2)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.multirank
def test_torchrun_tiny_config_learns():
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "hybridrl.trainer.megatron_smoke"]
    cmd += ["tiny_cpu.yaml", "trainer.n_gpus_per_node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert "tp=2 pp=1 dp=1 (world 2)" in out
    assert "[smoke] learned" in out, out[-3000:]
