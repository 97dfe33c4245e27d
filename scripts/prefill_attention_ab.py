"""Prefill seconds with the oneDNN GEMM attention (``logitspec.kernels.gemm_attention``) against SDPA,
alternating in one process, float32 (the embedded model by default).

    .venv/bin/python scripts/prefill_attention_ab.py [--rounds 3] [--model qwen] [--products]

Cases: the throughput harness's 24 rows (6 Spec-Bench first turns, four times: 2,808 tokens on Gemma 3, packed
into one prefill) and one prompt of 2,048 and of 8,192 random tokens (512-token chunks). Per case
and round, both kernels run once (order alternating); the table gives each round's seconds.
``--products`` first times the score product alone (4 query heads of T rows against T keys, D 256,
Gemma 3's shape): ``torch.matmul`` (MKL) against oneDNN's GEMM, the best of 5 x 20 calls.
"""
import argparse

import torch

from logitspec import Engine, SpecConfig
from logitspec.bench.questions import first_turns
from logitspec.bench.throughput import batch_prompts
from logitspec.device import elapsed, fastest
from logitspec.kernels import gemm_attention, onednn
from logitspec.models import load_model

CPU = torch.device("cpu")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default="default", help="a model name or path, as for `logitspec throughput`")
    ap.add_argument("--products", action="store_true", help="also time the score product alone")
    args = ap.parse_args()
    if args.products:
        products()
    model, tok = load_model(args.model)
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
                    secs[use] = elapsed(run, CPU)
                print(f"| {name} | {r + 1} | {secs[False]:.2f} | {secs[True]:.2f} |", flush=True)
    gemm_attention.ENABLED = True


def products() -> None:
    """GFLOP/s of Q K^T for T = 128, 322 and 1,288 by MKL (``torch.matmul``) and by oneDNN."""
    print("| T | MKL GFLOP/s | oneDNN GFLOP/s |\n|---|---|---|")
    with torch.inference_mode():
        for t in (128, 322, 1288):
            q, k = torch.randn(4 * t, 256), torch.randn(t, 256)  # [4T, D], [T, D]
            flops = 2 * 4 * t * t * 256
            rates = [flops * 20 / fastest(lambda: [f() for _ in range(20)], CPU, reps=5) / 1e9
                     for f in (lambda: q @ k.T, lambda: onednn.linear(q, k))]
            print(f"| {t} | {rates[0]:.0f} | {rates[1]:.0f} |", flush=True)


if __name__ == "__main__":
    main()
