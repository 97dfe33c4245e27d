"""Rows per second of the bare engine on many short prompts (the job's scale workload without the job):
random token-id prompts, a few new tokens, one engine per method side by side after a warm-up.

    python scripts/short_rows_bench.py --model /tmp/js_scale/model --rows 1024 --batch 64 --threads 1

``--model``: a HF model dir (``scripts/scale_check.py`` builds its tiny random Llama under
``--work``/model) or ``default``. Prints one JSON line per method: rows/s, tokens/s and the engine's
run stats (``prefill_chunks``: prefill forwards, against ``prefills``: prompts).
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from logitspec import Engine, SpecConfig
from logitspec.models import load_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--prompt-tokens", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--batch", type=int, default=64, help="max_batch_size")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--methods", default="ar,logitspec")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    rng = np.random.default_rng(0)
    vocab = min(500, int(model.config.get_text_config(decoder=True).vocab_size))
    prompts = [rng.integers(3, vocab, args.prompt_tokens).tolist() for _ in range(args.rows)]
    for method in args.methods.split(","):
        eng = Engine(model, tok, SpecConfig(method=method, max_batch_size=args.batch))
        eng.run(prompts[:args.batch], max_new_tokens=args.max_new_tokens)  # warm-up (and calibration)
        t0 = time.perf_counter()
        run = eng.run(prompts, max_new_tokens=args.max_new_tokens)
        wall = time.perf_counter() - t0
        keep = ("tokens", "batch_steps", "mean_active", "prefills", "prefill_chunks")
        print(json.dumps({"method": method, "rows": args.rows, "batch": args.batch, "threads": args.threads,
                          "rows_per_s": round(args.rows / wall, 1), "tokens_per_s": round(run.stats["tokens"] / wall, 1),
                          **{k: run.stats[k] for k in keep}}), flush=True)


if __name__ == "__main__":
    main()
