#!/usr/bin/env bash
# Lint, type-check, import contracts and the test suite, as CI runs them. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" PYTHONHASHSEED=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
echo "== ruff"; .venv/bin/ruff check src tests benchmarks examples
echo "== mypy --strict src"; .venv/bin/mypy --strict src
echo "== import contracts"; .venv/bin/lint-imports
echo "== pytest"
set +e
.venv/bin/python -m pytest -q "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: treating as failure"; exit 1; fi
exit "$rc"
