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
# tcmalloc, preloaded into the processes that run the model (logitspec/allocator.py: a few percent a
# step, no result changes): best effort, where apt-get runs as root; without it the system allocator is used
if ! ldconfig -p 2>/dev/null | grep -q libtcmalloc && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  timeout 120 apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 \
    || { timeout 120 apt-get update -q >/dev/null 2>&1 && timeout 120 apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1; } \
    || echo "tcmalloc: not installed (the system allocator is used)"
fi
# build the CPU skinny-linear kernel now (about a minute, once) rather than in the first job
python -c "from logitspec.kernels.skinny import available, unavailable_reason; print('skinny kernel:', 'ready' if available() else unavailable_reason())"
echo "setup done: $(python -c 'import torch, transformers, ray; from logitspec import allocator; print("torch", torch.__version__, "transformers", transformers.__version__, "ray", ray.__version__, "tcmalloc", allocator.library() or "absent")')"
