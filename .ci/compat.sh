#!/usr/bin/env bash
# Prove the oldest end of the supported range: Python 3.12 with torch 2.11.0 / torchvision 0.26.0 runs the quick
# suite (pytest -m "not slow"). Run from the repository root: bash .ci/compat.sh [extra pytest args]
#
# Builds .venv-compat312/ (ignored) from requirements.txt with two changes, written to
# .venv-compat312/requirements-compat.txt:
#   - torch==2.11.0 and torchvision==0.26.0 replace the pins torch==2.14.1 / torchvision==0.29.1;
#   - the lines that are torch 2.14.1's own dependencies are left out, so that pip installs the ones torch 2.11.0
#     declares instead: triton, cuda-toolkit, cuda-bindings, cuda-pathfinder and the nvidia-* CUDA libraries
#     (nvidia-cublas, nvidia-cudnn-cu13, ...). Their pinned versions belong to torch 2.14.1's CUDA build and
#     conflict with torch 2.11.0's (which gets e.g. triton 3.6.0, nvidia-cudnn-cu13 9.19.0.56, nvidia-nccl-cu13
#     2.28.9 where requirements.txt pins 3.8.0, 9.24.0.43, 2.30.7). nvidia-ml-py (NVML bindings, not a torch
#     dependency) stays pinned.
# Everything else keeps its pin. PyPI's torch 2.11.0 Linux wheel is a CUDA build (~3 GB with its nvidia-*
# dependencies); it runs on CPU, which is all the quick suite needs.
#
# Rerunnable: an environment whose completion mark (the digest of requirements-compat.txt and the Python version,
# written only after pip succeeded) matches is reused as it is; any other is removed and built again.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${COMPAT_VENV:-.venv-compat312}
TORCH=2.11.0
TORCHVISION=0.26.0

PY=${PYTHON:-python3.12}
if ! "$PY" -c '' 2>/dev/null; then   # pyenv installs it without putting python3.12 on PATH by default
  PY=$(PYENV_VERSION=$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.|$)' | tail -1) pyenv which python3.12 \
       2>/dev/null) || { echo "compat.sh: Python 3.12 not found (set PYTHON=/path/to/python3.12)" >&2; exit 1; }
fi
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 12), f"Python 3.12 needed, found {sys.version}"'

reqs=$(
  grep -v -i -E '^(torch|torchvision|triton|cuda-toolkit|cuda-bindings|cuda-pathfinder|nvidia-[a-z0-9-]+)==' \
    requirements.txt
  grep -i -E '^nvidia-ml-py==' requirements.txt || true   # not part of torch's CUDA stack: keep its pin
  echo "torch==$TORCH"
  echo "torchvision==$TORCHVISION"
)
want=$(printf '%s\n%s\n' "$reqs" "$("$PY" --version)" | sha256sum | cut -d' ' -f1)

if [ "$(cat "$VENV/.compat.sha256" 2>/dev/null)" != "$want" ]; then
  rm -rf "$VENV"                                    # a build cut short (no completion mark) starts over
  "$PY" -m venv "$VENV"
  printf '%s\n' "$reqs" > "$VENV/requirements-compat.txt"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --quiet -r "$VENV/requirements-compat.txt"
  echo "$want" > "$VENV/.compat.sha256"            # the completion mark
fi

"$VENV/bin/python" - <<EOF
import sys, torch, torchvision
print(f"compat.sh: Python {sys.version.split()[0]}, torch {torch.__version__}, torchvision {torchvision.__version__}")
assert sys.version_info[:2] == (3, 12), sys.version
assert torch.__version__.split("+")[0] == "$TORCH", torch.__version__
assert torchvision.__version__.split("+")[0] == "$TORCHVISION", torchvision.__version__
EOF

# The tests start subprocesses as "python -m ...", so the environment's bin/ goes first on PATH (as activate does).
export VIRTUAL_ENV="$PWD/$VENV" PATH="$PWD/$VENV/bin:$PATH"
export AWS_EC2_METADATA_DISABLED=true PREFECT_SERVER_ANALYTICS_ENABLED=false DVC_NO_ANALYTICS=1   # as .ci/run
exec python -m pytest -q -m "not slow" "$@"
