#!/usr/bin/env bash
# Download into DIR (default .whl/) the wheels the GPU image lacks for the GPU suite and benchmarks,
# for its Python 3.12 (cp312, manylinux x86_64). Run it on a machine with package-index access:
#
#     bash scripts/gpu_wheels.sh [DIR]
#     bash scripts/test_gpu.sh --wheels .whl          # then, on the GPU machine (DIR travels with it)
#
# The GPU image already holds torch, triton, transformers, safetensors, tokenizers, peft, psutil,
# numpy, pytest, pytest-timeout and hypothesis. Pinned versions: megatron-core 0.19.2 is the release
# that runs there (0.17+ need Python >= 3.12; docs/performance.md); liger-kernel 0.8.5 is the
# logprob benchmark's baseline. --no-deps: their needs (torch, numpy, packaging, triton) are in the
# image.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-$ROOT/.whl}"
PY="${PYTHON:-python3}"
WHEELS=(
  "megatron-core==0.19.2"
  "liger-kernel==0.8.5"
)
mkdir -p "$DIR"
for spec in "${WHEELS[@]}"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$DIR" "$spec"
done
ls -1 "$DIR"
