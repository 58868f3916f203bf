"""``reward.overlap_generation`` in Ray mode: each host actor scores the responses (or trajectories) it generates
while its engine still runs, as an SPMD rank does, and the run is the one that scores after generation.

``python -m hybridrl train ... trainer.launcher=ray`` (one driver, 2 host actors on a local Ray), 2 GRPO steps, with
a custom scorer that raises on some prompts and runs past ``reward.timeout_s`` on others: overlap on (the default)
and off, same seeds. Every metric but timings and ``perf/`` equal (losses, grad norms, rewards, error and timeout
counts, both > 0): the scores the hosts computed while generating are the driver's batch call's. Only the run with
overlap logs ``perf/reward_scored_during_generation``. (``agent/engine_steps`` is left out too: the loop's steps
depend on when the environments' answers arrive, in either mode.) Single-turn (2 rollout replicas) and multi-turn
(``tiny_cpu_agent.yaml``, ``guess_number``).

The hosts rebuild the scorer inside ``generate_sequences``: one that loads on the driver but not on the hosts stops
the run with one ``reward error:`` line naming the fix (not Ray's traceback). At rollout TP 2 (one engine over both
hosts) the scorer is called once per response, by the replica's first host only, as the driver would call it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.workers.test_ray_mode import GRPO, compared

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.multirank
TRAINER = Path(__file__).parents[1] / "trainer"
SINGLE = ("tiny_cpu.yaml", *GRPO, f"reward.custom.path={TRAINER / 'overlap_scorer.py'}")
AGENT = (
    "tiny_cpu_agent.yaml", "rollout.agent.env=guess_number", "rollout.agent.max_turns=3",
    "rollout.agent.max_tokens_per_turn=8", "data.train_batch_size=6", "rollout.n=2", "actor.ppo_mini_batch_size=6",
    "actor.ppo_micro_batch_size_per_gpu=6", "data.max_prompt_length=48", "data.max_response_length=48",
    "reward.scorer=auto", f"reward.custom.path={TRAINER / 'agent_overlap_scorer.py'}",
)  # fmt: skip


def _train(out: Path, *overrides: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hybridrl", "train", *overrides, "trainer.launcher=ray", "trainer.total_steps=2",
           "trainer.loggers=[jsonl]", "trainer.test_freq=-1", "trainer.save_freq=-1", "reward.timeout_s=1.0",
           f"trainer.default_local_dir={out}"]  # fmt: skip
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, **(env or {})}
    env.update(OMP_NUM_THREADS="1", HYBRIDRL_DEMO_WARMUP_STEPS="20")
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)


def _launch(out: Path, *overrides: str, env: dict[str, str] | None = None) -> list[dict]:
    result = _train(out, *overrides, env=env)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("run", [SINGLE, AGENT], ids=["single_turn", "agent"])
def test_ray_overlap_matches_scoring_after(tmp_path, run):
    on = _launch(tmp_path / "on", *run)
    off = _launch(tmp_path / "off", *run, "reward.overlap_generation=false")
    assert [r["step"] for r in on] == [r["step"] for r in off] == [1, 2]
    for a, b in zip(on, off, strict=True):
        # the agent loop's engine steps depend on when environment answers arrive (threads): a scheduling number
        a_, b_ = ({k: v for k, v in compared(r).items() if k != "agent/engine_steps"} for r in (a, b))
        assert a_.keys() == b_.keys(), sorted(a_.keys() ^ b_.keys())
        assert {k: (a_[k], b_[k]) for k in a_ if a_[k] != b_[k]} == {}
        assert 0 <= a["perf/reward_scored_during_generation"] <= 1 and "perf/reward_scored_during_generation" not in b
    assert sum(r["reward/errors"] for r in on) > 0 and sum(r["reward/timeouts"] for r in on) > 0, on


def test_a_scorer_that_fails_to_load_on_the_hosts_stops_the_run_in_one_line(tmp_path):
    scorer = Path(__file__).with_name("ray_host_fail_scorer.py")
    result = _train(tmp_path, "tiny_cpu.yaml", *GRPO, f"reward.custom.path={scorer}")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and lines, (result.stdout + result.stderr)[-4000:]
    assert lines[-1].startswith("reward error: on a rollout host: reward.custom.path") and "Traceback" not in lines[-1]
    assert "JUDGE_API_KEY is not set on this node" in lines[-1], lines[-1]
    assert lines[-1].endswith("set reward.overlap_generation=false to score on the driver"), lines[-1]
    assert "RaySystemError" not in result.stderr


def test_rollout_tp2_scores_each_response_once(tmp_path):
    calls = tmp_path / "calls.txt"
    scorer = Path(__file__).with_name("ray_count_scorer.py")
    rows = _launch(tmp_path / "run", "tiny_cpu.yaml", *GRPO, f"reward.custom.path={scorer}", "rollout.tp_size=2",
                   env={"HYBRIDRL_TEST_SCORER_CALLS": str(calls)})  # fmt: skip
    pids = calls.read_text().split()
    assert len(rows) == 2 and 0 <= rows[0]["perf/reward_scored_during_generation"] <= 1
    assert len(pids) == 2 * 8 * 2 and len(set(pids)) == 1, sorted(set(pids))  # 2 steps x 8 prompts x n=2, one host
