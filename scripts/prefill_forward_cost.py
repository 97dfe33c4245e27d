"""What one prefill forward costs by how many short prompts it carries: a forward's fixed cost
(the weights read, the layers run) against its cost per prompt, on the embedded model.

    .venv/bin/python scripts/prefill_forward_cost.py

Random token-id prompts of 30 and 120 tokens, 1, 2, 4 and 8 to a forward (``TargetForward.prefill_rows``,
back to back, as the session refills slots); the best of 5 after one warm-up.
"""
import time

import torch

from logitspec import Engine, SpecConfig
from logitspec.models import load_model


def main() -> None:
    model, tok = load_model("default")
    target = Engine(model, tok, SpecConfig(method="ar", max_batch_size=8)).target
    g = torch.Generator().manual_seed(0)
    print("| prompt tokens | prompts a forward | ms |\n|---|---|---|")
    with torch.inference_mode():
        for length in (30, 120):
            for k in (1, 2, 4, 8):
                group = [torch.randint(1000, 20000, (length,), generator=g).tolist() for _ in range(k)]
                target.prefill_rows(group, exact=False, argmax=True)
                best = float("inf")
                for _ in range(5):
                    t0 = time.perf_counter()
                    target.prefill_rows(group, exact=False, argmax=True)
                    best = min(best, time.perf_counter() - t0)
                print(f"| {length} | {k} | {best * 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    main()
