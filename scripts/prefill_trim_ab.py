"""Prefill one long prompt with sliding-window layers attending over their window only (the
engine's default) and over the whole cache, side by side in one process.

    .venv/bin/python scripts/prefill_trim_ab.py out/longbench_8k/lcc.jsonl --tokens 8000 [--vllm]

The first row's ``context`` of a LongBench-format file is the prompt; both ways must give the same
next token (printed). ``--vllm`` then prefills the same token ids with vLLM's CPU backend (float32,
its own environment, docs/performance.md): one new token, so its time is the prefill's.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from logitspec.models import load_model
from logitspec.target import TargetForward


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data", help="a LongBench-format .jsonl file")
    p.add_argument("--tokens", type=int, default=8000, help="prompt tokens (the context cut to this)")
    p.add_argument("--model", default="default")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (the engine's default)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--vllm", action="store_true", help="also time vLLM's CPU backend on the same ids")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    with open(args.data) as f:
        ids = tok(json.loads(f.readline())["context"]).input_ids[:args.tokens]
    target = TargetForward(model)
    kinds = target.layer_kinds
    if kinds is None:
        raise SystemExit(f"{args.model} has no sliding-window layers: nothing to compare")
    for rep in range(args.repeats):
        for trim in (True, False):
            target.layer_kinds = kinds if trim else None
            t0 = time.perf_counter()
            with torch.inference_mode():
                _, last = target.prefill(ids, args.chunk)
            dt = time.perf_counter() - t0
            print(f"repeat {rep} {'window only' if trim else 'whole cache'}: {len(ids)} tokens in {dt:.1f} s = "
                  f"{len(ids) / dt:.0f} tokens/s; next token {int(last.argmax[0])}", flush=True)
    if args.vllm:
        from logitspec.bench import vllm_baseline

        python, why = vllm_baseline.find_python(None)
        if python is None:
            raise SystemExit(why)
        with vllm_baseline.Runner(python, model.config._name_or_path, "plain", 1, 1, ids[:64], threads=args.threads,
                                  max_model_len=len(ids) + 64) as runner:
            for _ in range(args.repeats):  # one new token per round: tokens/s x prompt = prefill rate
                rec = runner.round(1, [ids])
                print(f"vLLM plain: {len(ids)} tokens prefilled at {rec['tokens_per_s'] * len(ids):.0f} tokens/s "
                      f"(start-up {runner.engine_init_s:.0f} s); next token {rec['token_ids'][0][0]}", flush=True)


if __name__ == "__main__":
    main()
