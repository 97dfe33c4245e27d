#!/usr/bin/env bash
# GPU check of tensor parallelism (docs/tensor_parallel.md): TP=1 vs TP=2 through the job on the
# embedded model (or $MODEL), float32 so both sides can be compared token for token:
#   1. ar, batch 1: equal generations and the step-time ratio (wall_s / steps of each row);
#   2. logitspec: equal generations;
#   3. logitspec with --runner graph: each rank's steps captured in CUDA graphs with their collectives
#      (NCCL, 2+ GPUs) and decided from the vocabulary-parallel head: equal generations (a rank whose
#      step cannot be captured ends the group: the job's log names the error).
# With >= 2 GPUs each rank gets its own GPU (NCCL). With one GPU the two ranks share it (gloo): the
# outputs still compare, but the ratio then says nothing about TP speed.
# Budget: under 10 minutes on one machine (6 job runs; the first model conversion is extra).
#
#   bash scripts/gpu_tp_check.sh            # results in ${OUT:-out/gpu_tp_check}/{ar,logitspec,logitspec-graph}/result.json
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu_tp_check}
MODEL=${MODEL:-default}
ROWS=${ROWS:-8}
NEW=${NEW:-64}
PY=${PY:-python}
[ -x .venv/bin/python ] && PY=.venv/bin/python
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1

nvidia-smi -L || { echo "no GPU (nvidia-smi failed)"; exit 2; }
NGPU=$(nvidia-smi -L | grep -c '^GPU')
$PY - <<'PY' || { echo "missing dependencies: install the project (pip install -e .) with a CUDA torch"; exit 2; }
import torch, transformers, deepspeed, ray
assert torch.cuda.is_available(), "torch has no CUDA"
print("torch", torch.__version__, "cuda", torch.version.cuda, "| transformers", transformers.__version__,
      "| deepspeed", deepspeed.__version__, "| ray", ray.__version__, "|", torch.cuda.get_device_name(0))
PY
if [ "$NGPU" -ge 2 ]; then SHARE=1.0; else SHARE=0.5; fi
echo "GPUs: $NGPU; gpus per rank: $SHARE; model: $MODEL; rows: $ROWS; new tokens: $NEW"
# The first use of "default" converts the GGUF once (CPU, minutes) before any timing starts.
$PY -c "from logitspec.models import resolve_model_path as r; print('model dir', r('$MODEL'))" || exit 2

rc=0
for CASE in ar:auto logitspec:auto logitspec:graph; do
  METHOD=${CASE%%:*}; RUNNER=${CASE##*:}; NAME=$METHOD; [ "$RUNNER" = auto ] || NAME=$METHOD-$RUNNER
  timeout 420 $PY scripts/tp_measure.py --gpu --gpus-per-rank "$SHARE" --tp 2 --model "$MODEL" \
      --method "$METHOD" --runner "$RUNNER" --rows "$ROWS" --max-new-tokens "$NEW" --dtype float32 \
      --out "$OUT/$NAME" > "$OUT/$NAME.stdout" 2> "$OUT/$NAME.stderr"
  r=$?; [ $r -ne 0 ] && rc=$r
  echo "== $NAME: exit $r"
  $PY - "$OUT/$NAME/result.json" <<'PY' || tail -n 40 "$OUT/$NAME.stderr"
import json, sys
d = json.load(open(sys.argv[1]))
keys = ("equal_generations", "mismatched_ids", "step_time_ratio_tp2_over_tp1")
print({k: d.get(k) for k in keys})
for name, run in d["runs"].items():
    print(name, {k: run.get(k) for k in ("device_of_rank0", "step_s_median", "replica_ready_s", "model_load_s", "job_wall_s")},
          [(r["rank"], r["model_bytes"]) for r in run["per_rank"]])
PY
done
[ -n "${OUT_COPY:-}" ] && cp -r "$OUT" "$OUT_COPY"
exit $rc
