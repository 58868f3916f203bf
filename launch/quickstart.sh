#!/usr/bin/env bash
# The demo: install (once), then run the main job on a tiny model made on the spot, on CPU.
#
# Today (until the RL trainer lands) the main job trains the tiny Llama of configs/tiny_cpu.yaml with
# Megatron-Core tensor parallelism over 2 CPU processes (gloo) and checks that it learns.
#
# Knobs:
#   NPROC   processes (CPU ranks)                     default 2
#   CONFIG  config name or path                       default tiny_cpu.yaml
# Extra arguments are config overrides: bash launch/quickstart.sh actor.megatron.tp_size=1
set -euo pipefail
NPROC=${NPROC:-2}
CONFIG=${CONFIG:-tiny_cpu.yaml}

# shellcheck source=launch/bootstrap.sh
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$HYBRIDRL_ROOT"

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
RUN_ARGS=(--standalone --nnodes 1 --nproc-per-node "$NPROC")
JOB_ARGS=("$CONFIG" "trainer.nnodes=1" "trainer.n_gpus_per_node=$NPROC")
"$HYBRIDRL_VENV/bin/torchrun" "${RUN_ARGS[@]}" -m hybridrl.trainer.megatron_smoke "${JOB_ARGS[@]}" "$@"
