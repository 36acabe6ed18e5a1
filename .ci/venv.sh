#!/usr/bin/env bash
# Create .venv (Python 3.11) once and (re)install the pinned requirements only when requirements.txt changed.
# Used by the README's two commands and by .ci/run. Run from the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), f"Python 3.11 needed, found {sys.version}"'
[ -x .venv/bin/python ] || "$PY" -m venv .venv
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ "$(cat .venv/.requirements.sha256 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -r requirements.txt
  echo "$want" > .venv/.requirements.sha256
fi
