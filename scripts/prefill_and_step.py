"""Prefill seconds and decode ms per step of our engine on the throughput prompts at 6 and 24 rows.

    .venv/bin/python scripts/prefill_and_step.py ar,logitspec [--dtype bfloat16] [--model qwen]

Per round, method and batch size: a 1-token run (its wall time is the prefill's) and a 64-token
run; ms per step = (64-token wall - 1-token wall) / (steps - 1). The same split for vLLM:
``scripts/vllm_prefill_and_step.py``.
"""
import argparse
import json

from logitspec import Engine, SpecConfig
from logitspec.bench.questions import first_turns, warmup_question
from logitspec.bench.throughput import batch_prompts
from logitspec.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("methods", nargs="?", default="ar", help="comma-separated engine methods")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--model", default="default", help="a model name or path, as for `logitspec throughput`")
    args = ap.parse_args()
    methods = args.methods.split(",")
    model, tok = load_model(args.model, dtype=args.dtype)
    engines = {(m, b): Engine(model, tok, SpecConfig(method=m, max_batch_size=b)) for m in methods for b in (6, 24)}
    warm = warmup_question(tok, model.config.get_text_config(decoder=True).vocab_size).turns[0]
    for e in engines.values():
        e.generate([warm], max_new_tokens=8)
    prompts = first_turns(None, 1, max_chars=1500)
    for _ in range(2):
        for (m, b), e in engines.items():
            rows = batch_prompts(prompts, b)
            first = e.run(rows, max_new_tokens=1).stats["wall_s"]
            s = e.run(rows, max_new_tokens=64).stats
            print(json.dumps({"method": m, "rows": b, "prefill_s": round(first, 3), "wall_s": round(s["wall_s"], 3),
                              "tokens_per_s": round(s["tokens_per_s"], 1), "steps": s["batch_steps"],
                              "step_ms": round((s["wall_s"] - first) / (s["batch_steps"] - 1) * 1e3, 1)}), flush=True)


if __name__ == "__main__":
    main()
