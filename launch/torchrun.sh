#!/usr/bin/env bash
# PPO/GRPO (or SFT / DPO) on one machine (a workstation, a login node, a single GPU node) or on a few nodes by hand.
#
#   bash launch/torchrun.sh                                   # tiny_cpu.yaml on its 2 ranks (CPU, or 2 GPUs)
#   bash launch/torchrun.sh sft                               # hybridrl sft (tiny_cpu_sft.yaml); dpo likewise
#   CONFIG=ppo_llama2_7b.yaml bash launch/torchrun.sh trainer.total_steps=10   # arguments are config overrides
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 bash launch/torchrun.sh ...        # by hand on node 1 of 2
#   DRY_RUN=1 bash launch/torchrun.sh                         # validate and print the command only
#
# On Slurm use launch/slurm_ppo.sh instead. The config and the run's inputs are validated before torchrun
# starts, so a typo in an override or a missing data file fails in seconds with one line (exit 2), nothing
# launched; an error a rank meets later is one line too.
#
# Knobs (environment):
#   CONFIG             config name or path (from the caller's folder)  default tiny_cpu.yaml (sft / dpo:
#                                                                     tiny_cpu_sft.yaml / tiny_cpu_dpo.yaml)
#   NPROC              processes on this node; "auto": one per         default the config's
#                      visible GPU (2 CPU processes without GPUs)      trainer.n_gpus_per_node
#   NNODES             nodes                                          default 1
#   NODE_RANK          this node's rank                               default 0
#   MASTER_ADDR        node 0's address                               default 127.0.0.1
#   MASTER_PORT        rendezvous port on node 0                      default 29500
#   HYBRIDRL_BOOTSTRAP 1: create/update <repo>/.venv first (launch/bootstrap.sh; PYTHON then names the
#                      interpreter that creates it)                   default 0
#   PYTHON             the environment's interpreter                  default <repo>/.venv/bin/python
#   DRY_RUN            1: validate the config, then print the torchrun command instead of running it
#   HYBRIDRL_VERBOSE   1: every library warning and torchrun's own failure report  default 0
set -euo pipefail

HYBRIDRL_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=launch/command.sh
source "$HYBRIDRL_ROOT/launch/command.sh"
hybridrl_command "$@"
shift "$COMMAND_ARGS"
if [ "$COMMAND" = train ]; then CONFIG=${CONFIG:-tiny_cpu.yaml}; else CONFIG=${CONFIG:-tiny_cpu_$COMMAND.yaml}; fi
# A config file named relative to the caller's directory, made absolute before the cd below (a packaged
# name that is not a file here stays a name).
if [ -f "$CONFIG" ]; then CONFIG="$(cd "$(dirname "$CONFIG")" && pwd)/$(basename "$CONFIG")"; fi
NPROC=${NPROC:-}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
HYBRIDRL_BOOTSTRAP=${HYBRIDRL_BOOTSTRAP:-0}
DRY_RUN=${DRY_RUN:-0}

if [ "$HYBRIDRL_BOOTSTRAP" = 1 ]; then
  # shellcheck source=launch/bootstrap.sh
  source "$HYBRIDRL_ROOT/launch/bootstrap.sh"
  PYTHON=$HYBRIDRL_PY
fi
PYTHON=${PYTHON:-$HYBRIDRL_ROOT/.venv/bin/python}

cd "$HYBRIDRL_ROOT"
[ -x "$PYTHON" ] || command -v "$PYTHON" >/dev/null 2>&1 || {
  echo "[torchrun.sh] error: no python at $PYTHON; set PYTHON, or HYBRIDRL_BOOTSTRAP=1 to create .venv" >&2
  exit 1
}
if [ "$NPROC" = auto ]; then
  GPUS=0
  if command -v nvidia-smi >/dev/null 2>&1; then GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true); fi
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ] && [ "$GPUS" -gt 0 ]; then
    IFS=, read -ra VISIBLE <<<"$CUDA_VISIBLE_DEVICES"
    GPUS=${#VISIBLE[@]}
  fi
  if [ "$GPUS" -gt 0 ]; then NPROC=$GPUS; else NPROC=2; fi
elif [ -z "$NPROC" ]; then
  # The ranks the config is sized for (its batch rules assume them); a config error stops here, in one line.
  NPROC=$("$PYTHON" -m hybridrl validate-config "$CONFIG" "trainer.nnodes=$NNODES" "$@" "${RECIPE[@]}" \
    --get trainer.n_gpus_per_node)
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # ranks share the cores; torchrun would set 1 with a warning
export CUDA_DEVICE_MAX_CONNECTIONS=1          # Megatron: one hardware queue keeps TP comm ordered (no-op on CPU)

# Static rendezvous: node NODE_RANK of NNODES, node 0 at MASTER_ADDR:MASTER_PORT hosts the store.
TORCHRUN_ARGS=(
  --nnodes "$NNODES" --nproc-per-node "$NPROC"
  --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
)
TRAIN_ARGS=("$CONFIG" "trainer.nnodes=$NNODES" "trainer.n_gpus_per_node=$NPROC")

# Every cross-field check before any rank starts; for a real launch also every input the run reads before its
# models (data files, tokenizer, local model folders, scorer, loggers, run folder), on this node.
INPUTS=(--inputs)
if [ "$DRY_RUN" = 1 ]; then INPUTS=(); fi
"$PYTHON" -m hybridrl validate-config "${TRAIN_ARGS[@]}" "$@" --quiet "${INPUTS[@]}" "${RECIPE[@]}" >&2

CMD=("$PYTHON" -m torch.distributed.run "${TORCHRUN_ARGS[@]}" -m hybridrl "$COMMAND" "${TRAIN_ARGS[@]}" "$@")
QUOTED=$(printf '%q ' "${CMD[@]}")
if [ "$DRY_RUN" = 1 ]; then
  echo "torchrun: ${QUOTED% }"
  exit 0
fi
echo "[torchrun.sh] ${QUOTED% }" >&2
# hybridrl.console passes the ranks' output through and condenses torchrun's own report of a failed rank to one
# line; exit 2 when a rank reported bad input (HYBRIDRL_VERBOSE=1: everything, as torchrun prints it).
exec "$PYTHON" -m hybridrl.console run "${CMD[@]}"
