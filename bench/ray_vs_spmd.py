"""Seconds per step and per stage of Ray mode vs SPMD on the same work: the demo PPO config on 2 CPU processes.

Both runs launch the real command line one after the other in this run, with the same config and seed (so the
same responses, the same work): ``torchrun --nproc-per-node 2 -m hybridrl train tiny_cpu.yaml`` (SPMD, the
baseline) and ``python -m hybridrl train tiny_cpu.yaml trainer.launcher=ray`` (one driver, a local Ray of 2 CPUs,
2 host actors). Step 1 is a warm-up (vLLM's first calls, the first weight push) and is dropped; the other steps
are averaged. Stages are ``RLTrainer.train_step``'s (``timing_s/<stage>``): in Ray mode each includes the driver
splitting the batch, Ray's transfers and collecting the results. ``start`` is the whole launch (imports, actors,
models, engines) until the last step's metrics. The ratio column is Ray / SPMD.

    python bench/ray_vs_spmd.py [--steps 4] [--keep DIR]
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


def run(out_dir: str, mode: str, steps: int) -> tuple[list[dict], float]:
    """Train ``steps`` steps in ``mode`` ("spmd" | "ray"); returns the metrics rows and the launch's seconds."""
    if mode == "spmd":
        cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc-per-node", "2"]
    else:
        cmd = [sys.executable]
    cmd += ["-m", "hybridrl", "train", "tiny_cpu.yaml", f"trainer.total_steps={steps}", "trainer.loggers=[jsonl]",
            f"trainer.default_local_dir={out_dir}"]  # fmt: skip
    if mode == "ray":
        cmd.append("trainer.launcher=ray")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    start = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"{mode} run failed:\n{(result.stdout + result.stderr)[-3000:]}")
    with open(os.path.join(out_dir, "logs", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f], seconds


def mean_after_warmup(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if r.get("step", 0) > 1 and key in r]
    return sum(values) / len(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per run (the first is dropped)")
    parser.add_argument("--keep", default=None, help="write the runs here instead of a temporary folder")
    args = parser.parse_args()
    if args.steps < 2:
        sys.exit("--steps must be >= 2 (step 1 is a warm-up)")
    root = args.keep or tempfile.mkdtemp(prefix="ray_vs_spmd_")
    spmd, spmd_s = run(os.path.join(root, "spmd"), "spmd", args.steps)
    ray, ray_s = run(os.path.join(root, "ray"), "ray", args.steps)
    same = all(abs(a["actor/loss"] - b["actor/loss"]) <= 1e-6 for a, b in zip(spmd, ray, strict=True))
    print(f"tiny_cpu.yaml PPO, 2 processes, steps 2..{args.steps} averaged; same actor losses: {same}")
    print(f"{'':16}{'spmd s':>10}{'ray s':>10}{'ray/spmd':>10}")
    for key in ("step", *STAGES):
        a, b = mean_after_warmup(spmd, f"timing_s/{key}"), mean_after_warmup(ray, f"timing_s/{key}")
        print(f"{key:16}{a:10.3f}{b:10.3f}{b / a if a else float('nan'):10.2f}")
    print(f"{'start':16}{spmd_s:10.1f}{ray_s:10.1f}{ray_s / spmd_s:10.2f}")


if __name__ == "__main__":
    main()
