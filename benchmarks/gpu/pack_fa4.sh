#!/usr/bin/env bash
# Pack flash-attn-4 and its CuTe DSL (CUDA 13 flavour) for the lent H200, which has no network and takes
# at most 64 MiB of working tree per call. Run here (where pip reaches PyPI), from the repository root:
#
#     bash benchmarks/gpu/pack_fa4.sh          # writes .fa4/fa4site.tar.xz (~53 MiB; about 7 min of xz)
#
# then carry ".fa4" in the device call; run_h200.sh unpacks it into /tmp/fa4 and puts it on PYTHONPATH.
# The wheels are unpacked, not installed (they are cp312, this machine's Python may differ). Left out, to
# fit: the cu12 flavour, torch-c-dlpack-ext (no build for the GPU image's torch 2.11, which has the DLPack
# exchange API itself), the tvm-ffi C++ sources and headers, the iket profiler tools, the aarch64 stubs,
# einops' tests and flash-attn-4's benchmark scripts. cutlass.jax and libtvm_ffi_testing.so stay: cutlass
# and tvm_ffi import them. The image already has cuda-bindings, cuda-pathfinder and protobuf.
set -euo pipefail
OUT_DIR="${1:-.fa4}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
PLAT=(--python-version 3.12 --only-binary=:all: --no-deps
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64)
for req in flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
           nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 \
           "apache-tvm-ffi>=0.1.11,<0.2" "quack-kernels>=0.5.3" einops; do
  python3 -m pip download -q "${PLAT[@]}" -d "$WORK/wheels" "$req"
done
mkdir -p "$WORK/site"
for w in "$WORK"/wheels/*.whl; do unzip -q -o "$w" -d "$WORK/site"; done
S="$WORK/site"
rm -rf "$S"/tvm_ffi/3rdparty "$S"/tvm_ffi/src "$S"/tvm_ffi/cython "$S"/tvm_ffi/include \
       "$S"/nvidia_cutlass_dsl/dsl_packages/iket "$S"/nvidia_cutlass_dsl/cu13/lib/stubs \
       "$S"/einops/tests "$S"/flash_attn/cute/benchmark*.py
mkdir -p "$OUT_DIR"
# a 256 MiB dictionary finds the long-range repeats inside the 190 MB MLIR library (53 MiB against 61)
tar cf - -C "$WORK" site | xz -T1 --x86 --lzma2=preset=9e,dict=256MiB > "$OUT_DIR/fa4site.tar.xz"
ls -la "$OUT_DIR/fa4site.tar.xz"
