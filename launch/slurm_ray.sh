#!/usr/bin/env bash
# PPO/GRPO in Ray mode on a Slurm cluster: a Ray head on the first node, a Ray worker on every other node, then
# one driver (on the batch node, the first node) runs the loop and places one actor per GPU (docs/ray.md).
#
#   sbatch launch/slurm_ray.sh trainer.save_freq=-1                 # 2 nodes x 8 GPUs, ppo_llama2_7b.yaml
#   sbatch --nodes=4 launch/slurm_ray.sh trainer.save_freq=-1 actor.optim.lr=5e-7   # arguments: config overrides
#   DRY_RUN=1 SLURM_JOB_NODELIST="gpu[01-02]" SLURM_JOB_NUM_NODES=2 bash launch/slurm_ray.sh key=value
#
# Submit from the repository root, or set HYBRIDRL_ROOT. The config is validated on the batch node before Ray
# starts. The Ray processes run as srun steps of this job: they end with it (the trap stops them by their pid).
# Ray mode writes no checkpoints yet: pass trainer.save_freq=-1 with a config that saves (the packaged 7B one does).
#
# Knobs (environment):
#   CONFIG          config name or path (from the submit folder)      default ppo_llama2_7b.yaml
#   NNODES          nodes                                             default $SLURM_JOB_NUM_NODES (else 1)
#   GPUS_PER_NODE   GPUs per node, one actor each                     default $SLURM_GPUS_ON_NODE (else 8)
#   CPUS_PER_NODE   CPUs each node offers Ray                         default $SLURM_CPUS_ON_NODE (else 64)
#   RAY_PORT        the head's GCS port                               default 6379 + SLURM_JOB_ID % 1000
#   RAY_WAIT_S      seconds to wait for every node to join            default 300
#   RAY_AUTH_MODE   Ray's RPC authentication (head, workers, driver)  default token
#   RAY_AUTH_TOKEN  its shared secret, handed to every node by srun   default a fresh random one per job
#   HYBRIDRL_ROOT   the repository                                    default this file's repo, else submit dir
#   VENV            virtual environment present on every node         default $HYBRIDRL_ROOT/.venv
#   PYTHON          its interpreter                                   default $VENV/bin/python
#   DRY_RUN         1: validate the config, then print the Ray and driver commands instead
#
#SBATCH --job-name=hybridrl-ray
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -f "$HERE/launch/slurm_ray.sh" ]; then ROOT_GUESS=$HERE; else ROOT_GUESS=${SLURM_SUBMIT_DIR:-$PWD}; fi
HYBRIDRL_ROOT=${HYBRIDRL_ROOT:-$ROOT_GUESS}
CONFIG=${CONFIG:-ppo_llama2_7b.yaml}
if [ -f "$CONFIG" ]; then CONFIG="$(cd "$(dirname "$CONFIG")" && pwd)/$(basename "$CONFIG")"; fi
NNODES=${NNODES:-${SLURM_JOB_NUM_NODES:-1}}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
CPUS_PER_NODE=${CPUS_PER_NODE:-${SLURM_CPUS_ON_NODE:-64}}
RAY_PORT=${RAY_PORT:-$((6379 + ${SLURM_JOB_ID:-0} % 1000))}
RAY_WAIT_S=${RAY_WAIT_S:-300}
VENV=${VENV:-$HYBRIDRL_ROOT/.venv}
PYTHON=${PYTHON:-$VENV/bin/python}
DRY_RUN=${DRY_RUN:-0}

die() { echo "[slurm_ray] error: $*" >&2; exit 1; }
quote() { local s; s=$(printf '%q ' "$@"); echo "${s% }"; }  # a command as one copy-pasteable line
cd "$HYBRIDRL_ROOT"
[ -x "$PYTHON" ] || command -v "$PYTHON" >/dev/null 2>&1 \
  || die "no python at $PYTHON; create the environment (bash launch/bootstrap.sh) or set VENV / PYTHON"
[ -n "${SLURM_JOB_NODELIST:-}" ] || die "SLURM_JOB_NODELIST is empty: submit with sbatch, or fake it for a dry run" \
  "(DRY_RUN=1 SLURM_JOB_NODELIST='gpu[01-02]' SLURM_JOB_NUM_NODES=2 bash launch/slurm_ray.sh)"

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
export RAY_ADDRESS="$HEAD:$RAY_PORT"
# Ray's `ray start` and its clients must agree on authentication; a per-job token needs no shared home folder.
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
if [ "$RAY_AUTH_MODE" = token ] && [ -z "${RAY_AUTH_TOKEN:-}" ]; then
  RAY_AUTH_TOKEN=$("$PYTHON" -c 'import secrets; print(secrets.token_hex(32))')
  export RAY_AUTH_TOKEN
fi

RESOURCES=(--num-cpus "$CPUS_PER_NODE" --num-gpus "$GPUS_PER_NODE")
HEAD_CMD=("$PYTHON" -m ray.scripts.scripts start --head --node-ip-address "$HEAD" --port "$RAY_PORT"
  --include-dashboard false "${RESOURCES[@]}" --block)
WORKER_CMD=("$PYTHON" -m ray.scripts.scripts start --address "$RAY_ADDRESS" "${RESOURCES[@]}" --block)
HEAD_SRUN=(--nodes 1 --ntasks 1 --nodelist "$HEAD" --overlap)
WORKER_SRUN=(--nodes "$((NNODES - 1))" --ntasks "$((NNODES - 1))" --ntasks-per-node 1 --exclude "$HEAD" --overlap)
TRAIN_ARGS=("$CONFIG" "trainer.launcher=ray" "trainer.nnodes=$NNODES" "trainer.n_gpus_per_node=$GPUS_PER_NODE")
DRIVER_CMD=("$PYTHON" -m hybridrl train "${TRAIN_ARGS[@]}" "$@")

"$PYTHON" -m hybridrl validate-config "${TRAIN_ARGS[@]}" "$@" --quiet >&2

if [ "$DRY_RUN" = 1 ]; then
  echo "head node: $HEAD"
  echo "ray head: $(quote srun "${HEAD_SRUN[@]}" "${HEAD_CMD[@]}")"
  if [ "$NNODES" -gt 1 ]; then echo "ray workers: $(quote srun "${WORKER_SRUN[@]}" "${WORKER_CMD[@]}")"; fi
  echo "driver: RAY_ADDRESS=$RAY_ADDRESS $(quote "${DRIVER_CMD[@]}")"
  exit 0
fi

PIDS=()
stop_ray() { for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap stop_ray EXIT
srun "${HEAD_SRUN[@]}" "${HEAD_CMD[@]}" &
PIDS+=($!)
if [ "$NNODES" -gt 1 ]; then
  srun "${WORKER_SRUN[@]}" "${WORKER_CMD[@]}" &
  PIDS+=($!)
fi
# Wait until every node has joined (the driver's pool check would otherwise see a partial cluster).
"$PYTHON" - "$NNODES" "$RAY_WAIT_S" <<'EOF' || die "the Ray cluster at $RAY_ADDRESS did not reach $NNODES node(s) in $RAY_WAIT_S s"
import os, sys, time
import ray
want, wait_s = int(sys.argv[1]), float(sys.argv[2])
deadline = time.time() + wait_s
while True:
    try:
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
        break
    except Exception:
        if time.time() > deadline:
            sys.exit(1)
        time.sleep(2)
while sum(n["Alive"] for n in ray.nodes()) < want:
    if time.time() > deadline:
        sys.exit(1)
    time.sleep(2)
EOF
echo "[slurm_ray] Ray cluster of $NNODES node(s) at $RAY_ADDRESS; $(quote "${DRIVER_CMD[@]}")" >&2
"${DRIVER_CMD[@]}"
