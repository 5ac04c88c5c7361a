#!/usr/bin/env bash
# THE GPU test command. On a CUDA machine, from anywhere in the repository:
#
#     bash scripts/test_gpu.sh [--wheels DIR] [--log FILE] [pytest args...]
#
# Runs, in one pytest session, the conformance suites (tests/conformance) on cuda and every test marked
# `gpu` (tests/gpu and the gpu cases of tests/unit): `pytest -m "gpu or conformance"` with
# UNDERLAY_DEVICE=cuda. Ranks of multi-process tests start with `spawn` (tests/_dist.py picks it when
# CUDA is visible; UNDERLAY_TEST_START_METHOD=spawn is set here too), since a forked rank cannot
# initialise CUDA. NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends).
#
#   --wheels DIR  install the wheels in DIR (made by scripts/gpu_wheels.sh: megatron-core, liger-kernel,
#                 ...) with `pip install --no-index --no-deps --target` into a temporary site directory
#                 put first on PYTHONPATH; the environment itself is not changed.
#   --log FILE    where the whole output goes (tee); default underlay_out/gpu_tests.log. Its head states
#                 the date, commit, GPU and versions: copy it into benchmarks/results/gpu_tests.md.
#   other args    passed to pytest (e.g. -x, -k fsdp2, --collect-only).
#
# Exit status: pytest's (non-zero on any failure; 5 when no test was collected); 2 without a CUDA device
# (except with --collect-only, which runs anywhere to check what would run).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
WHEELS=""
LOG="underlay_out/gpu_tests.log"
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) WHEELS="${2:?--wheels needs a directory}"; shift 2 ;;
    --wheels=*) WHEELS="${1#--wheels=}"; shift ;;
    --log) LOG="${2:?--log needs a file}"; shift 2 ;;
    --log=*) LOG="${1#--log=}"; shift ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
COLLECT_ONLY=0
for a in "${ARGS[@]+"${ARGS[@]}"}"; do
  case "$a" in --collect-only|--co) COLLECT_ONLY=1 ;; esac
done

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export UNDERLAY_TEST_START_METHOD="${UNDERLAY_TEST_START_METHOD:-spawn}"
export PYTHONPATH="$ROOT/src:$ROOT${PYTHONPATH:+:$PYTHONPATH}"

if [ -n "$WHEELS" ]; then
  ls "$WHEELS"/*.whl >/dev/null 2>&1 || { echo "test_gpu.sh: no wheels in $WHEELS (run scripts/gpu_wheels.sh)" >&2; exit 2; }
  SITE="$(mktemp -d "${TMPDIR:-/tmp}/underlay-site.XXXXXX")"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl \
    || { echo "test_gpu.sh: installing the wheels of $WHEELS failed" >&2; exit 2; }
  export PYTHONPATH="$SITE:$PYTHONPATH"
fi

if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  export UNDERLAY_DEVICE="${UNDERLAY_DEVICE:-cuda}"
elif [ "$COLLECT_ONLY" = 1 ]; then
  # no CUDA here: collect with the host's device (the conformance cases then carry [cpu] ids, and the
  # gpu tests collect and would skip); on a GPU machine the same selection runs on cuda
  echo "test_gpu.sh: no CUDA device visible: collecting only, with UNDERLAY_DEVICE=${UNDERLAY_DEVICE:-auto}" >&2
else
  echo "test_gpu.sh: no CUDA device visible; run it on a GPU machine (--collect-only works anywhere)" >&2
  exit 2
fi

mkdir -p "$(dirname "$LOG")"
{
  echo "# underlay GPU test suite"
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
  echo "command: bash scripts/test_gpu.sh${WHEELS:+ --wheels $WHEELS} ${ARGS[*]+"${ARGS[*]}"}"
  "$PY" - <<'PY'
import importlib.metadata as md, platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda})")
if torch.cuda.is_available():
    print("gpus:", ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))
for dist in ("triton", "transformers", "megatron-core", "liger-kernel", "flash-attn-4"):
    try:
        print(f"{dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"{dist}: not installed")
PY
} 2>&1 | tee "$LOG"

"$PY" -m pytest -p no:cacheprovider -rs -m "gpu or conformance" \
  tests/conformance tests/gpu tests/unit "${ARGS[@]+"${ARGS[@]}"}" 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
echo "test_gpu.sh: pytest exit status $rc; log in $LOG" | tee -a "$LOG"
exit "$rc"
