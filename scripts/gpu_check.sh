#!/usr/bin/env bash
# The device check (docs/gpu.md, "The device check"). By default the graph runner's parts: lossless greedy through
# the graph runner on tiny Llama / Qwen2 / Gemma 3, then on the Llama-3-8B shape (random bfloat16 weights)
# the HF static-cache graph step, our ar step (1/8/32/64 rows, greedy and sampled), an 8k-token prefill
# and the graph runner's tree curve; --parts all adds the eager parts (eager lossless, device paths, cost
# curves). Under 7 minutes on one H100 or H200 (no case starts past --budget-s 320; stopped at GPU_CHECK_TIMEOUT,
# default 400 s), so a rerun fits 15 minutes of device time; JSON and summary.json under OUT_DIR, the summary
# rewritten after every part.
#
#   bash scripts/gpu_check.sh [OUT_DIR] [gpu_check.py options]     # OUT_DIR defaults to $OUT, else out/gpu_check
#   bash scripts/gpu_check.sh out/check --tiny --device cpu         # CI-sized, on CPU
#
# Needs python with torch (CUDA) and transformers >= 5.23; no Ray, no DeepSpeed, no network. Where the
# machine's transformers is older, carry wheels in .whl/ (ignored by git; bash scripts/gpu_wheels.sh builds
# them): they are installed to /tmp/site and put first on PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-out/gpu_check}}
[ $# -gt 0 ] && shift
mkdir -p "$OUT_DIR"
PY=${PY:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
# the carried wheels only where this python's own releases are outside the tested range (logitspec/versions.py)
if compgen -G ".whl/*.whl" > /dev/null \
    && ! "$PY" -c "from logitspec.versions import check_versions; check_versions()" 2> /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing the carried wheels failed"; exit 2; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
PYTHONUNBUFFERED=1 timeout "${GPU_CHECK_TIMEOUT:-400}" "$PY" scripts/gpu_check.py --out "$OUT_DIR" "$@" 2>&1 | tee "$OUT_DIR/log.txt"
exit "${PIPESTATUS[0]}"
