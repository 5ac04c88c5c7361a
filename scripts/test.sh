#!/usr/bin/env bash
# Lint, type-check, import contracts and the test suite, as CI runs them. Exits non-zero on any failure.
#
# Without arguments the suite runs as three pytest processes at once (the megatron-core group followed
# by the verl group in .venv-verl, tests/distributed, everything else), so both cores stay busy; each
# group's log is printed when all are done. The verl group (tests/integrations/verl; verl 0.9.1's pins
# conflict with the main lock, so scripts/setup.sh verl builds .venv-verl, setup.sh dev too) fails, not
# skips, when verl is missing there. UNDERLAY_TEST_GROUPS=1 runs one pytest instead. Arguments go to a single
# pytest (e.g. scripts/test.sh tests/unit -x).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" PYTHONHASHSEED=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
venv="${UNDERLAY_VENV:-.venv}"
echo "== ruff"; "$venv"/bin/ruff check src tests benchmarks examples
echo "== mypy --strict src"; "$venv"/bin/mypy --strict src
echo "== import contracts"; "$venv"/bin/lint-imports

# pytest's exit code, with 5 ("no tests collected") turned into a failure
pytest_rc() {
  local rc=$1 name=$2
  if [ "$rc" -eq 5 ]; then echo "pytest ($name) collected no tests: treating as failure"; return 1; fi
  return "$rc"
}

set +e
if [ "$#" -gt 0 ] || [ "${UNDERLAY_TEST_GROUPS:-2}" = "1" ]; then
  echo "== pytest"
  "$venv"/bin/python -m pytest -q "$@"
  pytest_rc $? "all"
  exit $?
fi
logs=$(mktemp -d)
verl_venv="${UNDERLAY_VERL_VENV:-.venv-verl}"
# the verl group runs in its own environment (verl's pins); it must not be skipped
verl_group() {
  if [ -x "$verl_venv/bin/python" ] && "$verl_venv/bin/python" -c "import verl, underlay" 2>/dev/null; then
    "$verl_venv/bin/python" -m pytest -q -p no:cacheprovider --durations=5 tests/integrations/verl
  else
    echo "$verl_venv has no verl: run 'bash scripts/setup.sh verl' (the verl group cannot be skipped)"
    return 1
  fi
}
# three processes on the two cores: the megatron-core group then the verl group, the multi-process
# tests of tests/distributed, and everything else; each group's log is printed when all are done
echo "== pytest: mcore + verl, tests/distributed, the rest, in parallel (logs in $logs)"
start=$(date +%s)
( "$venv"/bin/python -m pytest -q -m mcore -p no:cacheprovider --durations=15 > "$logs/mcore.log" 2>&1
  echo $? > "$logs/mcore.rc"
  verl_group > "$logs/verl.log" 2>&1
  echo $? > "$logs/verl.rc" ) &
chain_pid=$!
"$venv"/bin/python -m pytest -q -m "not mcore" -p no:cacheprovider --durations=20 tests/distributed \
  > "$logs/distributed.log" 2>&1 &
dist_pid=$!
"$venv"/bin/python -m pytest -q -m "not mcore" -p no:cacheprovider --durations=20 tests \
  --ignore=tests/distributed > "$logs/rest.log" 2>&1
rest_rc=$?
wait "$dist_pid"
dist_rc=$?
wait "$chain_pid"
mcore_rc=$(cat "$logs/mcore.rc" 2>/dev/null || echo 1)
verl_rc=$(cat "$logs/verl.rc" 2>/dev/null || echo 1)
set -e
echo "== pytest -m 'not mcore' tests/distributed (rc $dist_rc)"; cat "$logs/distributed.log"
echo "== pytest -m 'not mcore' (the rest) (rc $rest_rc)"; cat "$logs/rest.log"
echo "== pytest -m mcore (rc $mcore_rc)"; cat "$logs/mcore.log"
echo "== pytest tests/integrations/verl in $verl_venv (rc $verl_rc)"; cat "$logs/verl.log"
echo "== pytest wall time: $(( $(date +%s) - start )) s"
ok=0
pytest_rc "$dist_rc" "not mcore, tests/distributed" || ok=1
pytest_rc "$rest_rc" "not mcore, the rest" || ok=1
pytest_rc "$mcore_rc" "mcore" || ok=1
pytest_rc "$verl_rc" "verl" || ok=1
exit "$ok"
