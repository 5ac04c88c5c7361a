#!/usr/bin/env bash
# Run the maintained benchmarks of one machine kind. From anywhere in the repository:
#
#     bash benchmarks/run.sh cpu [NAME ...] [--out DIR]                # the CPU set at smoke sizes (2-3 min)
#     bash benchmarks/run.sh gpu [NAME ...] [--out DIR] [--wheels DIR] # one H200: benchmarks/results/
#     bash benchmarks/run.sh gpu --fast [NAME ...] [--out DIR]          # fewer repeats: see GPU_FAST
#
# --fast (gpu): the issue-35 set (default names: weight_sync logprob arch_sweep) with fewer repeats and
# rounds, and arch_sweep (run last) given what is left of FAST_BUDGET_S (default 420 s) as its
# --budget-s, so the three fit one device call of 8 minutes.
# NAME: one of the names below (default: all of that kind). Each benchmark writes OUT/<name>.json and
# prints one summary line; OUT defaults to a new temporary directory (never the repository). The GPU set
# needs the wheels of scripts/gpu_wheels.sh for mcore (megatron-core) and the Liger row of logprob:
# --wheels DIR installs them into a temporary directory put first on PYTHONPATH.
# Exit status: the number of benchmarks that failed.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
export PYTHONPATH="$ROOT/src:$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# name -> module and arguments. cpu: smoke sizes that keep the whole set short on 2 cores (the recorded
# figures' commands are in benchmarks/results/); gpu: the recorded configurations.
declare -A CPU=(
  [balancing]="benchmarks.cpu.bench_balancing --repeats 3"
  [profiler_overhead]="benchmarks.cpu.bench_profiler_overhead --calls 50000 --repeats 3"
  [data]="benchmarks.cpu.bench_data --n 2000"
  [logprob_memory]="benchmarks.cpu.bench_logprob_memory --n 512 --vocab 32000"
  [weights_io]="benchmarks.cpu.bench_weights_io --tiny --verify --repeats 1 --file-mb 1"
)
CPU_ORDER=(balancing profiler_overhead data logprob_memory weights_io)
declare -A GPU=(
  [logprob]="benchmarks.gpu.bench_logprob"
  [attention]="benchmarks.gpu.bench_attention"
  [fp8]="benchmarks.gpu.bench_fp8"
  [fsdp2]="benchmarks.gpu.bench_fsdp2 --act-ckpt defaults,tuned"
  [arch_sweep]="benchmarks.gpu.bench_arch_sweep"
  [mcore]="benchmarks.gpu.bench_fsdp2 --mcore"
  [long_seq]="benchmarks.gpu.bench_long_seq"
  [vlm]="benchmarks.gpu.bench_vlm"
  [models_memory]="benchmarks.gpu.bench_models_memory"
  [weight_sync]="benchmarks.gpu.bench_weight_sync"
  [weights_io]="benchmarks.cpu.bench_weights_io --device cuda --world 1 --repeats 1"
  [reference_role]="benchmarks.gpu.bench_reference_role"
  [shared_prompt]="benchmarks.gpu.bench_shared_prompt"
  [mcore_overlap]="benchmarks.gpu.bench_mcore_overlap"
)
GPU_ORDER=(logprob attention fp8 fsdp2 arch_sweep mcore long_seq vlm models_memory weight_sync weights_io
  reference_role shared_prompt mcore_overlap)
# --fast: arguments appended to the GPU entry (arch_sweep also gets --budget-s, see above)
declare -A GPU_FAST=(
  [weight_sync]="--repeats 3"
  [logprob]="--rounds 3 --repeats 3"
  [arch_sweep]="--steps 1 --baseline none --timeout-s 150 --min-left-s 50"
)
FAST_ORDER=(weight_sync logprob arch_sweep)
FAST_BUDGET_S="${FAST_BUDGET_S:-420}"

usage() { echo "usage: bash benchmarks/run.sh {cpu|gpu} [--fast] [NAME ...] [--out DIR] [--wheels DIR]" >&2; exit 2; }
[ $# -ge 1 ] || usage
KIND=$1; shift
case "$KIND" in cpu|gpu) ;; *) usage ;; esac
OUT=""
WHEELS=""
FAST=0
NAMES=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="${2:?--out needs a directory}"; shift 2 ;;
    --out=*) OUT="${1#--out=}"; shift ;;
    --wheels) WHEELS="${2:?--wheels needs a directory}"; shift 2 ;;
    --fast) FAST=1; shift ;;
    -h|--help) usage ;;
    *) NAMES+=("$1"); shift ;;
  esac
done
if [ -n "$WHEELS" ]; then
  SITE="$(mktemp -d "${TMPDIR:-/tmp}/underlay-site.XXXXXX")"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl \
    || { echo "run.sh: installing the wheels of $WHEELS failed" >&2; exit 2; }
  export PYTHONPATH="$SITE:$PYTHONPATH"
fi
[ -n "$OUT" ] || OUT="$(mktemp -d "${TMPDIR:-/tmp}/underlay-bench.XXXXXX")"
mkdir -p "$OUT"
[ "$FAST" = 0 ] || [ "$KIND" = gpu ] || { echo "run.sh: --fast is a gpu option" >&2; exit 2; }
if [ "$KIND" = cpu ]; then ORDER=("${CPU_ORDER[@]}"); else ORDER=("${GPU_ORDER[@]}"); fi
if [ ${#NAMES[@]} -eq 0 ]; then
  if [ "$FAST" = 1 ]; then NAMES=("${FAST_ORDER[@]}"); else NAMES=("${ORDER[@]}"); fi
fi
fails=0
start=$(date +%s)
for name in "${NAMES[@]}"; do
  if [ "$KIND" = cpu ]; then cmd="${CPU[$name]:-}"; else cmd="${GPU[$name]:-}"; fi
  if [ -z "$cmd" ]; then
    echo "unknown $KIND benchmark '$name'; known: ${ORDER[*]}" >&2
    fails=$((fails + 1))
    continue
  fi
  if [ "$FAST" = 1 ]; then
    cmd="$cmd ${GPU_FAST[$name]:-}"
    if [ "$name" = arch_sweep ]; then
      left=$(( FAST_BUDGET_S - ($(date +%s) - start) ))
      cmd="$cmd --budget-s $(( left > 60 ? left : 60 ))"
    fi
  fi
  t0=$(date +%s)
  # shellcheck disable=SC2086  # cmd is a module name and its arguments
  if OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "$PY" -m $cmd --out "$OUT/$name" > "$OUT/$name.log" 2>&1; then
    echo "ok   $name ($(( $(date +%s) - t0 )) s): $(grep -E "^[a-z0-9_]+: " "$OUT/$name.log" | tail -n 1)"
  else
    echo "FAIL $name ($(( $(date +%s) - t0 )) s): see $OUT/$name.log"
    tail -n 5 "$OUT/$name.log" | sed 's/^/     /'
    fails=$((fails + 1))
  fi
done
echo "$fails failed in $(( $(date +%s) - start )) s; records and logs in $OUT"
exit "$fails"
