#!/usr/bin/env bash
# The wheels the device check carries to a lent GPU (docs/gpu.md, "On the next lent GPU"), into the ignored
# .whl/: the transformers the engine is tested with (logitspec/versions.py) in a release that imports on
# that machine's Python and hub library (transformers 5.24: 5.25 wants huggingface-hub >= 2.4, the lent
# machine has 1.33), and the regex build it needs. Pure Python but for regex; 64 MiB travel at most.
#
#   bash scripts/gpu_wheels.sh            # for the lent machine's CPython 3.12 (override: PYVER=3.11)
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${PYVER:-3.12}
PY=${PY:-python3}
rm -rf .whl && mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "transformers==5.24.0" "regex==2026.11.19"
du -sh .whl && ls .whl
