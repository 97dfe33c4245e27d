"""Side-by-side tokens/s of HF generate, ar and logitspec (auto, fixed 8) on one Spec-Bench prompt per task.

    .venv/bin/python scripts/compare_methods.py [threads]
"""
import torch, time, statistics, json, sys
from logitspec import Engine, SpecConfig, load_model
from logitspec.throughput import spec_bench_prompts
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
m, tok = load_model("default")
prompts = spec_bench_prompts(str(__import__("pathlib").Path(__file__).resolve().parents[2] / "shared/data/spec_bench/question.jsonl"), 1, max_chars=800)
ids = [tok(p).input_ids for p in prompts]
N = 32
engines = {"ar": Engine(m, tok, SpecConfig(method="ar")),
           "logitspec-auto": Engine(m, tok, SpecConfig(method="logitspec")),
           "logitspec-fixed8": Engine(m, tok, SpecConfig(method="logitspec", budget="fixed", capacity=8))}
def hf(p):
    with torch.inference_mode():
        return m.generate(torch.tensor([p]), max_new_tokens=N, do_sample=False)[0, len(p):].tolist()
for e in engines.values(): e.generate([ids[0]], max_new_tokens=4)
hf(ids[0][:20])
print("cost curve", engines["logitspec-auto"].cost_curve.to_dict() if engines["logitspec-auto"].cost_curve else None, flush=True)
T = {k: [] for k in ["hf", *engines]}; toks = {k: 0 for k in T}; mat = {k: [] for k in T}; same = {k: 0 for k in T}
for qi, p in enumerate(ids):
    order = list(T)[qi % 4:] + list(T)[:qi % 4]
    ref = None
    outs = {}
    for k in order:
        t = time.perf_counter()
        if k == "hf":
            out = hf(p)
        else:
            r = engines[k].generate([p], max_new_tokens=N)[0]; out = r.token_ids; mat[k].append(r.stats["mean_accepted"])
        dt = time.perf_counter() - t
        T[k].append(len(out) / dt); outs[k] = out
    for k in T: same[k] += outs[k] == outs["ar"]
    print(qi, {k: round(T[k][-1], 2) for k in T}, flush=True)
print("\nmethod | mean tok/s | speedup vs ar (mean over prompts) | MAT | same as ar")
for k in T:
    sp = statistics.mean(a / b for a, b in zip(T[k], T["ar"]))
    print(k, round(statistics.mean(T[k]), 2), round(sp, 2), round(statistics.mean(mat[k]), 2) if mat[k] else "-", f"{same[k]}/{len(ids)}")
