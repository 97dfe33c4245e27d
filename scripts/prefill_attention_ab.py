"""Prefill seconds with the oneDNN GEMM attention (``logitspec.kernels.gemm_attention``) against SDPA,
alternating in one process on the embedded model (float32).

    .venv/bin/python scripts/prefill_attention_ab.py [--rounds 3]

Cases: the throughput harness's 24 rows (6 Spec-Bench first turns, four times: 2,808 tokens packed
into one prefill) and one prompt of 2,048 and of 8,192 random tokens (512-token chunks). Per case
and round, both kernels run once (order alternating); the table gives each round's seconds.
"""
import argparse
import time

import torch

from logitspec import Engine, SpecConfig
from logitspec.bench.questions import first_turns
from logitspec.bench.throughput import batch_prompts
from logitspec.kernels import gemm_attention
from logitspec.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model, tok = load_model("default")
    engine = Engine(model, tok, SpecConfig(method="ar", max_batch_size=24))
    g = torch.Generator().manual_seed(0)
    rows = batch_prompts(first_turns(None, 1, max_chars=1500), 24)
    cases = {"24 short prompts": lambda: engine.run(rows, max_new_tokens=1)}
    for n in (2048, 8192):
        ids = torch.randint(1000, 20000, (n,), generator=g).tolist()
        cases[f"{n} tokens"] = lambda ids=ids: engine.target.prefill(ids, 512)
    print("| case | round | SDPA s | GEMM s |\n|---|---|---|---|")
    with torch.inference_mode():
        for name, run in cases.items():
            run()  # warm-up
            for r in range(args.rounds):
                secs = {}
                for use in ((False, True) if r % 2 == 0 else (True, False)):
                    gemm_attention.ENABLED = use
                    t0 = time.perf_counter()
                    run()
                    secs[use] = time.perf_counter() - t0
                print(f"| {name} | {r + 1} | {secs[False]:.2f} | {secs[True]:.2f} |", flush=True)
    gemm_attention.ENABLED = True


if __name__ == "__main__":
    main()
