#!/usr/bin/env bash
# Create .venv and install the project. CPU machines get the CPU build of torch (pinned, so pip never
# pulls a multi-GB CUDA build); machines with an NVIDIA driver keep whatever torch pip resolves.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    python -m pip install -q "torch>=2.4,<2.15"
  else
    python -m pip install -q "torch==2.13.0"
  fi
fi
python -m pip install -q -e ".[test]"
# build the CPU skinny-linear kernel now (about a minute, once) rather than in the first job
python -c "from logitspec.kernels.skinny import available, unavailable_reason; print('skinny kernel:', 'ready' if available() else unavailable_reason())"
echo "setup done: $(python -c 'import torch, transformers, ray; print("torch", torch.__version__, "transformers", transformers.__version__, "ray", ray.__version__)')"
