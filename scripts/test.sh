#!/usr/bin/env bash
# Lint, type-check, import contracts and the test suite, as CI runs them. Exits non-zero on any failure
# (pytest's "no tests collected", exit 5, included).
#
# Without arguments: ruff lint and format first (seconds; an error stops here), then five lanes at once so both
# cores stay busy to the end: mypy --strict + lint-imports followed by tests/conformance; the
# megatron-core group followed by the verl group in .venv-verl; tests/distributed without Ray; the Ray
# launcher tests; everything else. A lane ending early leaves a core idle while the last one finishes,
# so the lanes are cut to take about the same time. Each group's log, exit code and wall time are
# printed when all are done. The verl group (tests/integrations/verl; verl 0.9.1's pins conflict with
# the main lock, so scripts/setup.sh verl builds .venv-verl, setup.sh dev too) fails, not skips, when
# verl is missing there.
# UNDERLAY_TEST_GROUPS=1 runs one pytest instead.
# Arguments go to a single pytest (e.g. scripts/test.sh tests/unit -x), after the lint steps.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" PYTHONHASHSEED=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Python writes the bytecode of what it imports: scripts/setup.sh's environments hold none (uv does not
# compile at install) and a PYTHONDONTWRITEBYTECODE inherited from the shell would make every process of
# the suite (the pytest lanes, their forkservers, each Ray actor, each subprocess) compile torch and
# transformers from source again: about 9 CPU seconds more per process that imports them.
unset PYTHONDONTWRITEBYTECODE
venv="${UNDERLAY_VENV:-.venv}"
verl_venv="${UNDERLAY_VERL_VENV:-.venv-verl}"
echo "== ruff"; "$venv"/bin/ruff check src tests benchmarks examples
# the format of every Python file and every Python block of the Markdown pages (ruff formats both)
"$venv"/bin/ruff format --check -q . || { echo "ruff format: run '$venv/bin/ruff format .'" >&2; exit 1; }

lint() {
  echo "== mypy --strict src"; "$venv"/bin/mypy --strict src || return 1
  echo "== import contracts"; "$venv"/bin/lint-imports
}

# pytest's exit code, with 5 ("no tests collected") turned into a failure
pytest_rc() {
  local rc=$1 name=$2
  if [ "$rc" -eq 5 ]; then echo "pytest ($name) collected no tests: treating as failure"; return 1; fi
  return "$rc"
}

if [ "$#" -gt 0 ] || [ "${UNDERLAY_TEST_GROUPS:-}" = "1" ]; then
  lint
  echo "== pytest"
  rc=0
  "$venv"/bin/python -m pytest -q "$@" || rc=$?
  pytest_rc "$rc" "all"
  exit $?
fi

pytest_cmd=("$venv"/bin/python -m pytest -q -p no:cacheprovider --durations=25)
# megatron-core tests live in tests/mcore, each file marked mcore (tests/unit/test_ci_lanes.py checks both),
# so the mcore lane collects that folder only and the rest lane leaves it out
group_mcore() { "${pytest_cmd[@]}" -m mcore tests/mcore; }
# the verl group runs in its own environment (verl's pins); it must not be skipped
group_verl() {
  if [ -x "$verl_venv/bin/python" ] && "$verl_venv/bin/python" -c "import verl, underlay" 2>/dev/null; then
    "$verl_venv/bin/python" -m pytest -q -p no:cacheprovider --durations=5 tests/integrations/verl
  else
    echo "$verl_venv has no verl: run 'bash scripts/setup.sh verl' (the verl group cannot be skipped)"
    return 1
  fi
}
group_distributed() { "${pytest_cmd[@]}" -m "not ray" tests/distributed; }
group_ray() { "${pytest_cmd[@]}" -m ray tests/distributed; }
group_conformance() { "${pytest_cmd[@]}" tests/conformance; }
group_rest() { "${pytest_cmd[@]}" tests --ignore=tests/distributed --ignore=tests/conformance --ignore=tests/mcore; }
group_lint() { lint; }

logs=$(mktemp -d)
# run_lane GROUP...: the groups one after the other, each with its log, exit code and wall seconds
run_lane() {
  local g t0
  for g in "$@"; do
    t0=$SECONDS
    "group_$g" > "$logs/$g.log" 2>&1
    echo $? > "$logs/$g.rc"
    echo $((SECONDS - t0)) > "$logs/$g.s"
  done
}
lanes=("mcore verl" "distributed" "ray" "rest" "lint conformance")
echo "== mypy + import contracts and pytest (lanes: ${lanes[*]/%/;}) at once; logs in $logs"
start=$SECONDS
set +e
pids=()
for lane in "${lanes[@]}"; do
  # shellcheck disable=SC2086  # a lane is a list of group names
  run_lane $lane &
  pids+=($!)
done
wait "${pids[@]}"
set -e
ok=0
for g in lint conformance distributed ray rest mcore verl; do
  rc=$(cat "$logs/$g.rc" 2>/dev/null || echo 1)
  echo "== $g (rc $rc, $(cat "$logs/$g.s" 2>/dev/null || echo '?') s)"
  cat "$logs/$g.log"
  if [ "$g" = lint ]; then
    [ "$rc" -eq 0 ] || ok=1
  else
    pytest_rc "$rc" "$g" || ok=1
  fi
done
echo "== wall time of the jobs: $((SECONDS - start)) s" \
  "($(for g in lint distributed ray rest mcore verl; do printf '%s %s s, ' "$g" "$(cat "$logs/$g.s" 2>/dev/null)"; done))"
exit "$ok"
