#!/usr/bin/env bash
# Download into DIR (default .whl/) the wheels the GPU image lacks for the GPU suite and benchmarks,
# for its Python 3.12 (cp312, manylinux x86_64). Run it on a machine with package-index access:
#
#     bash scripts/gpu_wheels.sh [DIR]
#     bash scripts/test_gpu.sh --wheels .whl          # then, on the GPU machine (DIR travels with it)
#     bash scripts/gpu_wheels.sh --verl [DIR]         # verl 0.9.1 and what its import needs that the image
#                                                     # lacks: DIR (default .whl-verl/) and DIR-arrow/, each
#                                                     # under the 64 MiB one device call carries
#                                                     # (benchmarks/gpu/bench_verl_backend.py, docs/verl.md)
#
# The GPU image already holds torch, triton, transformers, safetensors, tokenizers, peft, psutil,
# numpy, pytest, pytest-timeout and hypothesis. Pinned versions: megatron-core 0.19.2 is the release
# that runs there (0.17+ need Python >= 3.12; docs/performance.md); liger-kernel 0.8.5 is the
# logprob benchmark's baseline. --no-deps: their needs (torch, numpy, packaging, triton) are in the
# image.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERL=
WHEELS=(
  "megatron-core==0.19.2"
  "liger-kernel==0.8.5"
)
if [ "${1:-}" = "--verl" ]; then
  shift
  # verl 0.9.1 and the packages `import verl` plus its FSDP engine, config and loss modules load that the GPU
  # image lacks (found by tracing those imports in .venv-verl), at constraints/verl.txt's versions. verl pins
  # transformers<5.11; the image has 5.17 (installed --no-deps, verl runs on the image's transformers).
  # Two things are too large for one device call (64 MiB with the working tree): `import verl` imports
  # ray (verl/protocol.py), whose cp312 wheel is 79 MB: below, its Java jar (ray/jars/ray_dist.jar, 31 MB
  # compressed, used only by Java workers; ray checks for it and runs without) is taken out, which leaves
  # every Python module and binary of ray. verl's FSDP engine imports verl.utils.dataset, which imports
  # datasets, which needs pyarrow (55 MB; Arrow Flight, tests and headers taken out below) and pandas:
  # they go into DIR-arrow/, carried by a second call (docs/verl.md). antlr4-python3-runtime 4.9.3
  # (omegaconf's pin) has no wheel on the index: it is built here from its pure-Python sdist.
  VERL=1
  WHEELS=(
    "verl==0.9.1" "tensordict==0.10.0" "pyvers==0.1.0" "orjson==3.13.0" "ray==2.60.0" "msgpack==1.2.4"
    "click==8.5.1" "omegaconf==2.3.1" "hydra-core==1.3.8" "codetiming==1.4.0"
    "datasets==5.2.0" "dill==0.4.1" "multiprocess==0.70.19" "xxhash==4.1.0"
    "python-dateutil==4.0.0" "six==1.17.0" "jsonschema==4.26.0"
    "jsonschema-specifications==2025.9.1" "referencing==0.37.0" "rpds-py==2026.9.1"
  )
  ARROW=("pyarrow==26.0.1" "pandas==3.1.1")
fi
DIR="${1:-$ROOT/.whl${VERL:+-verl}}"
PY="${PYTHON:-python3}"
download() {  # download DIR SPEC...
  local dir="$1"
  shift
  mkdir -p "$dir"
  for spec in "$@"; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$dir" "$spec"
  done
}
download "$DIR" "${WHEELS[@]}"
# strip WHEEL REGEX: rewrite WHEEL without the files whose path matches REGEX (and their RECORD lines)
strip() {
  "$PY" - "$1" "$2" <<'PYEOF'
import os, re, sys, zipfile

src, pattern = sys.argv[1], re.compile(sys.argv[2])
tmp = src + ".tmp"
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
    dropped = [n for n in zin.namelist() if pattern.match(n)]
    if not dropped:
        sys.exit(f"gpu_wheels.sh: nothing in {src} matches {pattern.pattern}; check the version")
    for info in zin.infolist():
        if pattern.match(info.filename):
            continue
        data = zin.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            data = b"".join(l for l in data.splitlines(True) if not pattern.match(l.split(b",")[0].decode()))
        zout.writestr(info, data)
os.replace(tmp, src)
print(f"{os.path.basename(src)}: {len(dropped)} files left out ({pattern.pattern})")
PYEOF
}
if [ -n "$VERL" ]; then
  "$PY" -m pip wheel -q --no-deps --no-binary=:all: -w "$DIR" "antlr4-python3-runtime==4.9.3"
  strip "$DIR"/ray-2.60.0-*.whl 'ray/jars/'
fi
ls -1 "$DIR"
du -sh "$DIR"
if [ -n "$VERL" ]; then
  download "$DIR-arrow" "${ARROW[@]}"
  # pyarrow without Arrow Flight (RPC; only pyarrow.flight loads it), its C++ tests and headers
  strip "$DIR-arrow"/pyarrow-26.0.1-*.whl \
    'pyarrow/(libarrow_flight\.|libarrow_python_flight\.|_flight\.|flight\.py|_pyarrow_cpp_tests|tests/|include/|src/)'
  ls -1 "$DIR-arrow"
  du -sh "$DIR-arrow"
fi
