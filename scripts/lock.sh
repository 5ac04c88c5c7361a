#!/usr/bin/env bash
# Refresh the dependency lock: install the newest releases in a throw-away environment, run the whole
# suite there (scripts/test_latest.sh), and only if it passes rewrite constraints/cpu.txt with exactly
# what was installed. Review and commit the diff; CI then installs that set.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(python3 -c 'import sys; print(sys.version_info[:2] == (3, 11))')" = "True" ] ||
  { echo "lock.sh: the lock is made on Python 3.11 (the CI machines' Python)" >&2; exit 2; }
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
bash scripts/test_latest.sh --keep "$dir"
{
  head -3 constraints/cpu.txt
  "$dir/venv/bin/pip" freeze --all --exclude-editable | sed 's/^torch==\(.*\)+cpu$/torch==\1/'
} > "$dir/cpu.txt"
mv "$dir/cpu.txt" constraints/cpu.txt
echo "lock.sh: constraints/cpu.txt rewritten; review 'git diff constraints/cpu.txt' and commit it"
