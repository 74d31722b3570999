#!/usr/bin/env bash
# CI's second leg (`make test-cuda-env`): omniweave as a GPU user installs it. The wheel built from
# this checkout goes into a venv with the newest torch + torchvision the package registry serves
# (CUDA builds; here they run on the CPU) and the runtime dependencies pip resolves for it (not the
# dev venv's pins), and .ci/cuda_smoke.py runs from a directory outside the checkout.
#
# The venv (~6 GB) is cached in $OMNIWEAVE_CI_CACHE (default ~/.cache/omniweave-ci), keyed by the
# torch / torchvision versions and pyproject.toml; only the omniweave wheel is reinstalled each time.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
TORCH="${OMNIWEAVE_CUDA_TORCH:-2.14.1}"
TORCHVISION="${OMNIWEAVE_CUDA_TORCHVISION:-0.29.1}"
PYTHON="${PYTHON:-python3}"
CACHE="${OMNIWEAVE_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/omniweave-ci}"
KEY="$( (echo "$TORCH $TORCHVISION"; "$PYTHON" --version; cat "$REPO/pyproject.toml") | sha256sum | cut -c1-12)"
VENV="$CACHE/cuda-env-$KEY"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
start=$SECONDS

echo "== cuda-env: omniweave wheel (built from a copy: the checkout gets no build/)"
mkdir -p "$WORK/src"
cp -r "$REPO/omniweave" "$REPO/pyproject.toml" "$REPO/README.md" "$WORK/src/"
find "$WORK/src" -name __pycache__ -prune -exec rm -rf {} +
if [ ! -f "$VENV/.complete" ]; then
  echo "== cuda-env: new venv $VENV (torch $TORCH, torchvision $TORCHVISION)"
  rm -rf "$VENV"
  mkdir -p "$CACHE"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q "torch==$TORCH" "torchvision==$TORCHVISION"
  "$VENV/bin/pip" install -q "torch==$TORCH" "torchvision==$TORCHVISION" "$WORK/src"  # + omniweave's runtime deps
  touch "$VENV/.complete"
  for old in "$CACHE"/cuda-env-*; do [ "$old" = "$VENV" ] || rm -rf "$old"; done  # older keys
fi
"$VENV/bin/pip" wheel -q --no-deps -w "$WORK/dist" "$WORK/src"
"$VENV/bin/pip" install -q --no-deps --force-reinstall "$WORK"/dist/omniweave-*.whl
"$VENV/bin/pip" check
echo "== cuda-env: venv ready in $((SECONDS - start)) s"

mkdir -p "$WORK/run"
cd "$WORK/run"  # outside the checkout: nothing of it is importable from here
env -u PYTHONPATH PATH="$VENV/bin:$PATH" OMP_NUM_THREADS=1 "$VENV/bin/python" "$REPO/.ci/cuda_smoke.py"
echo "== cuda-env: passed in $((SECONDS - start)) s"
