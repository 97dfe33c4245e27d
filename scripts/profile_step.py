"""Profile one engine decode step (decoder + logits) on a model: top ops by self CPU time.

    .venv/bin/python scripts/profile_step.py --model default --context 120 --new-tokens 1
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from logitspec import load_model
from logitspec.masks import StepRow
from logitspec.target import TargetForward


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--attn", default="sdpa", help="attn_implementation: sdpa or eager")
    ap.add_argument("--context", type=int, default=120)
    ap.add_argument("--new-tokens", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    model, _ = load_model(args.model, attn_implementation=args.attn)
    target = TargetForward(model)
    ctx = [(7 * i + 3) % 1000 for i in range(args.context)]
    with torch.inference_mode():
        kv, _ = target.prefill(ctx, chunk=len(ctx))
        row = StepRow.chain(len(ctx), list(range(5, 5 + args.new_tokens)))

        def step():
            target([row], kv, all_logits=True, exact=False)  # greedy: the screened output layer
            kv.commit([[]])

        step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
