#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment at ./.venv and install the pinned stack.
# Idempotent: re-installs only when requirements*.txt / constraints.txt / pyproject.toml change.
# Works on a fresh machine with nothing installed by hand (needs Python >= 3.12 somewhere).
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  for cand in "${SAO_PYTHON:-}" python3.12 python3.13 python3; do
    [ -n "$cand" ] || continue
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      command -v "$cand"; return 0
    fi
  done
  # pyenv installs that are not the active version (the pyenv shim refuses to run them)
  for cand in "$HOME"/.pyenv/versions/3.1[2-9]*/bin/python3 /usr/bin/python3.1[2-9] /usr/local/bin/python3.1[2-9]; do
    if [ -x "$cand" ] && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$cand"; return 0
    fi
  done
  return 1
}

VENV=.venv
STAMP="$VENV/.sao-installed"
want=$(cat requirements.txt requirements-nodeps.txt requirements-test.txt constraints.txt pyproject.toml | sha256sum | cut -d' ' -f1)

if [ ! -x "$VENV/bin/python" ]; then
  PY=$(find_python) || { echo "error: megatron-sao needs Python >= 3.12 (megatron-core 0.19); none found. Set SAO_PYTHON=/path/to/python3.12" >&2; exit 1; }
  echo "creating $VENV with $PY" >&2
  "$PY" -m venv "$VENV"
fi

if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
  echo "installing the pinned stack into $VENV (first time: a few minutes, ~5 GB: PyPI's torch is a CUDA build)" >&2
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --quiet -c constraints.txt -r requirements.txt
  "$VENV/bin/python" -m pip install --quiet --no-deps -r requirements-nodeps.txt
  # test-only: SGLang's Python client without its GPU server stack (see requirements-test.txt)
  "$VENV/bin/python" -m pip install --quiet --no-deps -r requirements-test.txt
  "$VENV/bin/python" -m pip install --quiet --no-deps -e .
  echo "$want" > "$STAMP"
fi
