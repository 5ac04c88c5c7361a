#!/usr/bin/env bash
# Set up a virtual environment for underlay on a fresh machine.
#   scripts/setup.sh [EXTRAS]     EXTRAS default: hf,config,tracking,mcore   ("dev": everything the tests need,
#                                 and .venv-verl too, both built at once)
#   scripts/setup.sh verl         .venv-verl: underlay with verl 0.9.1 (its pins conflict with the main lock) and
#                                 megatron-core (the mcore engine under verl), locked by constraints/verl.txt;
#                                 scripts/test.sh runs tests/integrations/verl in it
# Installs go through uv (pinned in the lock, bootstrapped once by this Python's pip), pointed at the
# indexes pip is configured with (index-url, extra-index-url, find-links, constraint; best version over
# all of them, as pip picks). torch is installed first and pinned (the CPU build on local disk); an
# unpinned torch would pull a CUDA build. Versions come from the committed lock, constraints/cpu.txt (the
# set the suite passed with), when this is the Python it was made for (3.11); UNDERLAY_LOCK=0 installs
# the newest releases instead (scripts/test_latest.sh). UNDERLAY_VENV names the environment's directory
# (default .venv). "dev" builds the two environments as two background jobs, each logging to a file
# (paths printed); a failure of either fails the set-up and prints the end of its log.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-hf,config,tracking,mcore}"
py="${PYTHON:-python3}"

# uv reads no pip configuration: hand it pip's indexes, links, constraints and certificate
# (variables already set for uv win).
uv_env=$("$py" - <<'EOF'
import shlex, subprocess, sys
out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
cfg: dict[str, str] = {}
for line in out.splitlines():  # "scope.key='value'"; the environment (":env:") beats the files
    key, sep, value = line.partition("=")
    if not sep:
        continue
    name = key.rsplit(".", 1)[-1]
    sep = "," if name == "find-links" else " "  # uv: comma-separated links, space-separated URLs/files
    value = sep.join(shlex.split(value))
    if key.startswith(":env:") or name not in cfg:
        cfg[name] = value
uv = {"index-url": "UV_INDEX_URL", "extra-index-url": "UV_EXTRA_INDEX_URL", "find-links": "UV_FIND_LINKS",
      "constraint": "UV_CONSTRAINT", "cert": "SSL_CERT_FILE", "default-timeout": "UV_HTTP_TIMEOUT"}
for name, var in uv.items():
    if cfg.get(name):
        print(f"export {var}=${{{var}:-{shlex.quote(cfg[name])}}}")
EOF
)
eval "$uv_env"
export UV_INDEX_STRATEGY="${UV_INDEX_STRATEGY:-unsafe-best-match}" UV_NO_PROGRESS=1

# lock_args LOCKFILE PYTHON: "-c LOCKFILE" when the lock applies (UNDERLAY_LOCK=1 and Python 3.11)
lock_args() {
  local pyver
  pyver=$("$2" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  if [ "${UNDERLAY_LOCK:-1}" = "1" ]; then
    if [ "$pyver" = "3.11" ]; then
      echo "-c $1"
    else
      echo "setup.sh: $1 is the lock for Python 3.11; Python $pyver installs unlocked versions" >&2
    fi
  fi
}

# uv itself, once for both environments (each also gets it as a locked package)
uv_home=$(mktemp -d "${TMPDIR:-/tmp}/underlay-uv.XXXXXX")
trap 'rm -rf "$uv_home"' EXIT
# shellcheck disable=SC2046  # lock_args is a list of words
"$py" -m pip install -q --root-user-action=ignore --target "$uv_home" $(lock_args constraints/cpu.txt "$py") uv
uv_bin="$uv_home/bin/uv"
echo "setup.sh: $("$uv_bin" --version) (${SECONDS} s)"

# build_env VENV LOCKFILE EXTRAS [PACKAGE...]: the environment VENV with torch, then underlay[EXTRAS]
# (editable) and PACKAGEs, from LOCKFILE; prints the versions it ended with
build_env() {
  local venv=$1 lockfile=$2 extras=$3 t0=$SECONDS
  shift 3
  [ -x "$venv/bin/python" ] || "$py" -m venv --without-pip "$venv"
  local lock
  # shellcheck disable=SC2207  # lock_args is a list of words
  lock=($(lock_args "$lockfile" "$venv/bin/python"))
  local uv=("$uv_bin" pip install -q --python "$venv/bin/python" "${lock[@]}")
  "${uv[@]}" "torch==${UNDERLAY_TORCH_VERSION:-2.13.0}"
  echo "setup.sh: $venv: torch installed ($((SECONDS - t0)) s)"
  "${uv[@]}" --upgrade-package pip pip uv -e ".[${extras}]" "$@"
  echo "setup.sh: $venv: underlay[$extras] installed ($((SECONDS - t0)) s)"
  "$venv/bin/python" -c "import torch, underlay; print('underlay', underlay.__version__, 'torch', torch.__version__)"
}

verl_env() {
  build_env "${UNDERLAY_VERL_VENV:-.venv-verl}" constraints/verl.txt verl,hf,mcore pytest pytest-timeout
  "${UNDERLAY_VERL_VENV:-.venv-verl}/bin/python" -W ignore -c \
    "import verl, megatron.core as m; print('verl', verl.__version__, 'megatron-core', m.__version__)"
}

case "$extras" in
  verl) verl_env ;;
  dev)
    logs=$(mktemp -d "${TMPDIR:-/tmp}/underlay-setup.XXXXXX")
    echo "setup.sh: building ${UNDERLAY_VENV:-.venv} and ${UNDERLAY_VERL_VENV:-.venv-verl} at once (logs: $logs)"
    build_env "${UNDERLAY_VENV:-.venv}" constraints/cpu.txt dev > "$logs/main.log" 2>&1 &
    main_pid=$!
    verl_env > "$logs/verl.log" 2>&1 &
    verl_pid=$!
    failed=0
    for job in main:$main_pid verl:$verl_pid; do
      rc=0
      wait "${job#*:}" || rc=$?
      if [ "$rc" -ne 0 ]; then
        echo "setup.sh: the ${job%%:*} environment failed (exit $rc); the end of $logs/${job%%:*}.log:" >&2
        tail -n 40 "$logs/${job%%:*}.log" >&2
        failed=1
      else
        grep '^setup.sh\|^underlay\|^verl' "$logs/${job%%:*}.log"
      fi
    done
    exit "$failed"
    ;;
  *) build_env "${UNDERLAY_VENV:-.venv}" constraints/cpu.txt "$extras" ;;
esac
