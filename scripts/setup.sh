#!/usr/bin/env bash
# Set up a virtual environment for underlay on a fresh machine.
#   scripts/setup.sh [EXTRAS]     EXTRAS default: hf,config,tracking,mcore   ("dev": everything the tests need,
#                                 and .venv-verl too)
#   scripts/setup.sh verl         .venv-verl: underlay with verl 0.9.1 (its pins conflict with the main lock),
#                                 locked by constraints/verl.txt; scripts/test.sh runs tests/integrations/verl in it
# torch is installed first and pinned (the CPU build on local disk); an unpinned torch would pull a CUDA build.
# Versions come from the committed lock, constraints/cpu.txt (the set the suite passed with), when this is
# the Python it was made for (3.11); UNDERLAY_LOCK=0 installs the newest releases instead
# (scripts/test_latest.sh). UNDERLAY_VENV names the environment's directory (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-hf,config,tracking,mcore}"
py="${PYTHON:-python3}"
venv="${UNDERLAY_VENV:-.venv}"
lockfile=constraints/cpu.txt
if [ "$extras" = "verl" ]; then
  venv="${UNDERLAY_VERL_VENV:-.venv-verl}"
  lockfile=constraints/verl.txt
  extras="verl,hf"
fi
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
lock=()
pyver=$("$venv/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
if [ "${UNDERLAY_LOCK:-1}" = "1" ]; then
  if [ "$pyver" = "3.11" ]; then
    lock=(-c "$lockfile")
  else
    echo "setup.sh: $lockfile is the lock for Python 3.11; Python $pyver installs unlocked versions" >&2
  fi
fi
"$venv/bin/python" -m pip install -q --upgrade "${lock[@]}" pip
"$venv/bin/python" -m pip install -q "torch==${UNDERLAY_TORCH_VERSION:-2.13.0}"
"$venv/bin/python" -m pip install -q "${lock[@]}" -e ".[${extras}]"
if [ "$extras" = "verl,hf" ]; then
  "$venv/bin/python" -m pip install -q "${lock[@]}" pytest pytest-timeout
  "$venv/bin/python" -c "import verl, underlay; print('underlay', underlay.__version__, 'verl', verl.__version__)"
  exit 0
fi
"$venv/bin/python" -c "import torch, underlay; print('underlay', underlay.__version__, 'torch', torch.__version__)"
if [ "$extras" = "dev" ]; then
  bash scripts/setup.sh verl
fi
