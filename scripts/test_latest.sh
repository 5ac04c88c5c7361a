#!/usr/bin/env bash
# Run the whole suite against the NEWEST releases of every dependency (not the lock), in a throw-away
# environment; CI never runs this. Use it before refreshing the lock (scripts/lock.sh does both).
#   scripts/test_latest.sh [--keep DIR]   the environment lives in DIR (kept) or a temp dir (removed)
# Exits with the suite's status.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=""
if [ "${1:-}" = "--keep" ]; then dir="$2"; else dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT; fi
export UNDERLAY_VENV="$dir/venv" UNDERLAY_LOCK=0 UNDERLAY_TEST_LATEST=1
bash scripts/setup.sh dev
"$UNDERLAY_VENV/bin/pip" freeze --exclude-editable > "$dir/freeze.txt"
echo "== newest releases installed (full list: $dir/freeze.txt)"
grep -iE '^(torch|transformers|megatron-core|ray|tensordict|peft|triton|safetensors|tokenizers)==' "$dir/freeze.txt" || true
bash scripts/test.sh
