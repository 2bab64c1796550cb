#!/usr/bin/env bash
# `make setup`: the project's virtual environment in .venv, with one line per step so a first
# run never sits silent. pip's full output goes to .venv/setup.log and is shown only on failure.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
venv=${VENV:-.venv}  # a test sets up a throwaway one
t0=$SECONDS
step() { printf 'setup: %s\n' "$*"; }

if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "setup: error: $python is not Python 3.11 or newer; set PYTHON=/path/to/python3.11" >&2
  exit 2
fi
if [[ ! -x $venv/bin/python ]]; then
  step "creating $venv with $("$python" --version 2>&1)"
  "$python" -m venv "$venv"
fi
log=$venv/setup.log
: > "$log"
run_pip() {
  # One line per package pip collects, so the first (slow) install shows where it is.
  if ! "$venv/bin/pip" "$@" --progress-bar off 2>&1 | tee -a "$log" \
      | awk '/^Collecting /{n++; printf "setup:   [%d] %s\n", n, $2; fflush()}'; then
    echo "setup: error: pip $* failed; its output:" >&2
    cat "$log" >&2
    exit 1
  fi
}
step "upgrading pip"
run_pip install --upgrade pip
step "installing gpu-agent (editable) with its test dependencies; the first time takes about a minute"
# setuptools tells every editable install of a multi-folder project to beware of same-named
# folders; ours are agent/, fake-gpu/ and hooks/, so the note is noise for a newcomer.
PYTHONWARNINGS="ignore:Editable installation" run_pip install -e '.[dev,e2e]'
installed=$("$venv/bin/pip" list --format=freeze 2>/dev/null | wc -l)
step "done in $((SECONDS - t0)) s: $installed packages in $venv; commands in $venv/bin (gpu-agent, fake-gpu)"
