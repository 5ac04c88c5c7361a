#!/usr/bin/env bash
# One H200 call: where underlay's fsdp2 loses to torchtitan on equal-length rows (profile of one step of
# each, Llama-3.2-1B shape), underlay's compile variants, and the Llama-3.1-8B shape side by side.
#
#     bash benchmarks/gpu/torchtitan_gap.sh OUT_DIR [WHEELS_DIR]
#
# WHEELS_DIR (default .whl) holds torchtitan 0.2.2 and its pure-Python needs (benchmarks/results/torchtitan.md).
set -uo pipefail
OUT="${1:?usage: torchtitan_gap.sh OUT_DIR [WHEELS_DIR]}"
WHEELS="${2:-.whl}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SITE="$(mktemp -d)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl || exit 1
export PYTHONPATH="$SITE:$ROOT/src:$ROOT" PYTHONUNBUFFERED=1
B="python3 -m benchmarks.gpu.bench_torchtitan"
quiet() { grep -v -e '^USDT' -e 'SyncActivityProfilerHandler'; }
timeout 200 $B --shape 1b --cases full --steps 8 --warmup 5 --profile --out "$OUT/1b" 2>&1 | quiet
timeout 100 $B --shape 1b --cases full --steps 8 --warmup 5 --trainers underlay \
  --underlay-options '{"compile": "layer"}' --tag _compile_layer --out "$OUT/1b" 2>&1 | quiet
timeout 100 $B --shape 1b --cases full --steps 8 --warmup 5 --trainers underlay --profile \
  --underlay-options '{"reshard_after_forward": true}' --tag _reshard --out "$OUT/1b" 2>&1 | quiet
timeout 100 $B --shape 1b --cases full --steps 8 --warmup 5 --trainers underlay --attention-dense-uniform \
  --tag _dense_uniform --out "$OUT/1b" 2>&1 | quiet
timeout 300 $B --shape 8b --cases full,rl --rows 1 --steps 8 --warmup 4 --out "$OUT/8b" 2>&1 | quiet
rm -f "$OUT"/*/*_trace.json "$OUT"/*/hf_*/*.safetensors
