#!/usr/bin/env bash
# Make .venv (Python 3.11) hold the pinned requirements. Used by the README's two commands and by .ci/run; run from
# the repository root.
#
# A checkout that already has a real .venv folder keeps it and reinstalls only when requirements.txt changed. A new
# checkout gets .venv as a link to one environment per requirements.txt digest, shared by every checkout of this
# user on this machine ($DETPIPE_VENV_HOME, default ~/.cache/detpipe/venvs/<sha256>): built once (under a lock,
# marked complete only after pip succeeded), so a fresh clone does not reinstall the same ~5 GB of wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), f"Python 3.11 needed, found {sys.version}"'
want=$(sha256sum requirements.txt | cut -d' ' -f1)

install() {  # install() DIR: create the venv DIR if missing and install the pinned requirements into it
  [ -x "$1/bin/python" ] || "$PY" -m venv "$1"
  "$1/bin/python" -m pip install --quiet --upgrade pip
  "$1/bin/python" -m pip install --quiet -r requirements.txt
}

if [ -d .venv ] && [ ! -L .venv ]; then          # a checkout's own environment
  if [ "$(cat .venv/.requirements.sha256 2>/dev/null)" != "$want" ]; then
    install .venv
    echo "$want" > .venv/.requirements.sha256
  fi
  exit 0
fi

home=${DETPIPE_VENV_HOME:-$HOME/.cache/detpipe/venvs}
target="$home/$want"
mkdir -p "$home"
(
  flock 9                                          # one build at a time; the others wait and reuse it
  if [ "$(cat "$target/.requirements.sha256" 2>/dev/null)" != "$want" ]; then
    rm -rf "$target"                               # a build cut short (no completion mark) starts over
    install "$target"
    echo "$want" > "$target/.requirements.sha256"  # the completion mark
  fi
) 9>"$home/.lock"
ln -sfn "$target" .venv
