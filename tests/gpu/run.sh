#!/usr/bin/env bash
# GPU checks (one CUDA device): installs the wheels in .whl/ into /tmp/site and runs tests/gpu/check.py.
# Usage (from anywhere): bash tests/gpu/run.sh [check.py args...]   e.g. --sections parity
# Needs .whl/ at the repo root (see tests/gpu/README.md for the download command). Results: $OUT/gpu_check.{json,log}.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PY=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/site}

shopt -s nullglob
wheels=(.whl/*.whl)
if [ "${#wheels[@]}" -eq 0 ]; then
  echo "[gpu] error: no wheels in $PWD/.whl; download them first (tests/gpu/README.md)" >&2
  exit 2
fi
if ! "$PY" -c 'import megatron.core' 2>/dev/null; then
  echo "[gpu] installing ${wheels[*]} into $SITE" >&2
  mkdir -p "$SITE"
  if "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "${wheels[@]}"
  else  # no pip: a wheel is a zip archive laid out for site-packages
    "$PY" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' "$SITE" "${wheels[@]}"
  fi
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"

# One process, world 1 (hybridrl.distributed.init_distributed reads these; NCCL when CUDA is present).
export RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1
export MASTER_PORT=${MASTER_PORT:-$((20000 + RANDOM % 20000))}
export CUDA_DEVICE_MAX_CONNECTIONS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore::UserWarning}

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
set +e
timeout "${GPU_CHECK_TIMEOUT:-540}" "$PY" tests/gpu/check.py "$@"
rc=$?
set -e
[ "$rc" -eq 124 ] && echo "[gpu] error: check.py ran past ${GPU_CHECK_TIMEOUT:-540}s" >&2
exit "$rc"
