#!/usr/bin/env bash
# Install what the tests need (once) and run the whole suite: lint, format check, pytest.
# Usage: bash tests/run.sh [pytest args...]     e.g. bash tests/run.sh -k protocol -x
set -euo pipefail
# shellcheck source=launch/bootstrap.sh
source "$(dirname "${BASH_SOURCE[0]}")/../launch/bootstrap.sh"
cd "$HYBRIDRL_ROOT"

# Build the csrc/ kernel once here (cached by torch), not inside whichever multi-rank test first needs it.
echo "[tests] native reshard kernel" >&2
"$HYBRIDRL_PY" -c "from hybridrl.ops._native import load; print(load().__file__)"

echo "[tests] ruff check + format" >&2
"$HYBRIDRL_PY" -m ruff check .
"$HYBRIDRL_PY" -m ruff format --check .

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
export VLLM_ENABLE_V1_MULTIPROCESSING=0
set +e
"$HYBRIDRL_PY" -m pytest --timeout=1200 --durations=30 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "[tests] error: pytest collected no tests; a run that checks nothing must not pass" >&2
  exit 1
fi
exit "$rc"
