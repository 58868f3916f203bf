#!/usr/bin/env bash
# PPO/GRPO on a Slurm cluster: one srun step runs torchrun once per node; torchrun starts one process per GPU.
#
#   sbatch launch/slurm_ppo.sh                                      # 2 nodes x 8 GPUs, ppo_llama2_7b.yaml
#   sbatch --nodes=4 launch/slurm_ppo.sh actor.optim.lr=5e-7        # arguments are config overrides
#   CONFIG=grpo_qwen2_7b.yaml sbatch launch/slurm_ppo.sh
#   CONFIG=my_sft.yaml sbatch launch/slurm_ppo.sh sft             # a first argument sft / dpo: that recipe
#   DRY_RUN=1 SLURM_JOB_NODELIST="gpu[01-02]" SLURM_JOB_NUM_NODES=2 bash launch/slurm_ppo.sh key=value
#
# Submit from the repository root (sbatch runs a spooled copy of this file, so the repository is found from
# the submit directory), or set HYBRIDRL_ROOT. The config is validated on the batch node before srun
# starts anything, so a typo in an override fails in seconds without touching the other nodes.
#
# Rendezvous: torchrun's c10d rendezvous, hosted on the first node of SLURM_JOB_NODELIST. Every node runs
# the same command line (no per-node variable, hence no `bash -c` quoting layer under srun); torchrun assigns
# node ranks as the agents join. (The static alternative, --node-rank $SLURM_NODEID --master-addr $HEAD,
# needs that variable expanded on each node; it buys a fixed node order, which nothing here relies on.)
#
# Knobs (environment):
#   CONFIG          config name or path (from the submit folder)      default ppo_llama2_7b.yaml
#   NNODES          nodes                                             default $SLURM_JOB_NUM_NODES (else 1)
#   GPUS_PER_NODE   processes per node, one per GPU                   default $SLURM_GPUS_ON_NODE (else 8)
#   MASTER_PORT     rendezvous port on the head node                  default 29500 + SLURM_JOB_ID % 1000
#   HYBRIDRL_ROOT   the repository                                    default this file's repo, else submit dir
#   VENV            virtual environment present on every node         default $HYBRIDRL_ROOT/.venv
#   PYTHON          its interpreter                                   default $VENV/bin/python
#   EXTRA_ENV       extra KEY=VALUE pairs exported to every rank      default none, e.g. "NCCL_DEBUG=INFO"
#   DRY_RUN         1: validate the config, then print the srun and per-node torchrun commands instead
#   HYBRIDRL_VERBOSE 1: every library warning and torchrun's own failure report   default 0
#
#SBATCH --job-name=hybridrl-ppo
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -f "$HERE/launch/slurm_ppo.sh" ]; then ROOT_GUESS=$HERE; else ROOT_GUESS=${SLURM_SUBMIT_DIR:-$PWD}; fi
HYBRIDRL_ROOT=${HYBRIDRL_ROOT:-$ROOT_GUESS}
CONFIG=${CONFIG:-ppo_llama2_7b.yaml}
# shellcheck source=launch/command.sh
source "$HYBRIDRL_ROOT/launch/command.sh"
hybridrl_command "$@"
shift "$COMMAND_ARGS"
# A config file named relative to the submit folder (the batch script's working directory), made absolute
# before the cd below (a packaged name that is not a file here stays a name).
if [ -f "$CONFIG" ]; then CONFIG="$(cd "$(dirname "$CONFIG")" && pwd)/$(basename "$CONFIG")"; fi
NNODES=${NNODES:-${SLURM_JOB_NUM_NODES:-1}}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
MASTER_PORT=${MASTER_PORT:-$((29500 + ${SLURM_JOB_ID:-0} % 1000))}
VENV=${VENV:-$HYBRIDRL_ROOT/.venv}
PYTHON=${PYTHON:-$VENV/bin/python}
EXTRA_ENV=${EXTRA_ENV:-}
DRY_RUN=${DRY_RUN:-0}

die() { echo "[slurm_ppo] error: $*" >&2; exit 1; }
quote() { local s; s=$(printf '%q ' "$@"); echo "${s% }"; }  # a command as one copy-pasteable line
cd "$HYBRIDRL_ROOT"
[ -x "$PYTHON" ] || command -v "$PYTHON" >/dev/null 2>&1 \
  || die "no python at $PYTHON; create the environment (bash launch/bootstrap.sh) or set VENV / PYTHON"
[ -n "${SLURM_JOB_NODELIST:-}" ] || die "SLURM_JOB_NODELIST is empty: submit with sbatch, or fake it for a dry run" \
  "(DRY_RUN=1 SLURM_JOB_NODELIST='gpu[01-02]' SLURM_JOB_NUM_NODES=2 bash launch/slurm_ppo.sh)"

# The rendezvous host: the first node of the allocation (scontrol where Slurm is installed).
if command -v scontrol >/dev/null 2>&1; then
  mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
else
  mapfile -t HOSTS < <("$PYTHON" -c 'import sys
from hybridrl.distributed import expand_nodelist
print("\n".join(expand_nodelist(sys.argv[1])))' "$SLURM_JOB_NODELIST")
fi
[ "${#HOSTS[@]}" -ge "$NNODES" ] \
  || die "NNODES ($NNODES) exceeds the ${#HOSTS[@]} node(s) of SLURM_JOB_NODELIST ($SLURM_JOB_NODELIST)"
HEAD=${HOSTS[0]}

# Communication. Site-specific: uncomment and set for your fabric.
# export NCCL_SOCKET_IFNAME=ib0       # interface for NCCL's bootstrap and socket traffic (`ip -br addr`)
# export NCCL_IB_HCA=mlx5             # InfiniBand adapters NCCL may use (`ibv_devices`)
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}  # INFO prints the topology and rings: the first thing to read on a hang
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}  # a failed collective kills the job
export CUDA_DEVICE_MAX_CONNECTIONS=1   # Megatron: one hardware queue keeps TP comm ordered before the GEMMs
if [ -n "$EXTRA_ENV" ]; then
  read -ra EXTRA_PAIRS <<<"$EXTRA_ENV"
  export "${EXTRA_PAIRS[@]}"
fi

# srun hands its environment (and the exports above) to every node.
SRUN_ARGS=(--nodes "$NNODES" --ntasks "$NNODES" --ntasks-per-node 1 --kill-on-bad-exit=1)
# srun stopped inheriting sbatch's --cpus-per-task in Slurm 22.05: without it torchrun's ranks share one core.
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then SRUN_ARGS+=(--cpus-per-task "$SLURM_CPUS_PER_TASK"); fi
TORCHRUN_ARGS=(
  --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE"
  --rdzv-backend c10d --rdzv-endpoint "$HEAD:$MASTER_PORT" --rdzv-id "${SLURM_JOB_ID:-hybridrl}"
)
TRAIN_ARGS=("$CONFIG" "trainer.nnodes=$NNODES" "trainer.n_gpus_per_node=$GPUS_PER_NODE")

# Every cross-field check, here on the batch node, before any rank starts; for a real launch also every input
# the run reads before its models (data files, tokenizer, local model folders, scorer, loggers, run folder).
INPUTS=(--inputs)
if [ "$DRY_RUN" = 1 ]; then INPUTS=(); fi
"$PYTHON" -m hybridrl validate-config "${TRAIN_ARGS[@]}" "$@" --quiet "${INPUTS[@]}" "${RECIPE[@]}" >&2

NODE_CMD=("$PYTHON" -m torch.distributed.run "${TORCHRUN_ARGS[@]}" -m hybridrl "$COMMAND" "${TRAIN_ARGS[@]}" "$@")
if [ "$DRY_RUN" = 1 ]; then
  echo "head node: $HEAD"
  echo "srun: $(quote srun "${SRUN_ARGS[@]}" "${NODE_CMD[@]}")"
  echo "per node: $(quote "${NODE_CMD[@]}")"
  exit 0
fi
echo "[slurm_ppo] head node $HEAD; $(quote srun "${SRUN_ARGS[@]}" "${NODE_CMD[@]}")" >&2
# hybridrl.console passes the ranks' output through and condenses torchrun's own report of a failed rank to one
# line; exit 2 when a rank reported bad input (HYBRIDRL_VERBOSE=1: everything, as torchrun prints it).
exec "$PYTHON" -m hybridrl.console run srun "${SRUN_ARGS[@]}" "${NODE_CMD[@]}"
