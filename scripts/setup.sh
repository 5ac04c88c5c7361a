#!/usr/bin/env bash
# Set up .venv for underlay on a fresh machine. Usage: scripts/setup.sh [EXTRAS]  (default: hf,config,tracking,mcore)
# torch is installed first and pinned (the CPU build on local disk); an unpinned torch would pull a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-hf,config,tracking,mcore}"
py="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$py" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==${UNDERLAY_TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q -e ".[${extras}]"
.venv/bin/python -c "import torch, underlay; print('underlay', underlay.__version__, 'torch', torch.__version__)"
