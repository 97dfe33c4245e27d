"""The screen's bfloat16 scores kept as they come against widened to float32 (the behaviour before
2026-12-02), one process: forward ms of B rows x n nodes of the model's own continuation.

    .venv/bin/python scripts/screen_scores_ab.py --batch-size 24 --nodes 1,2,4
"""
import argparse
import statistics
import time

import torch

from logitspec import load_model
from logitspec.calibrate import CONTEXT_CHUNK, own_continuations
from logitspec.masks import StepRow
from logitspec.target import TargetForward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=24)
    ap.add_argument("--nodes", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    B, sizes = args.batch_size, [int(x) for x in args.nodes.split(",")]
    model, _ = load_model("default")
    target = TargetForward(model)
    screen = target.head.screen
    if screen is None or "bf16" not in screen.passes:
        raise SystemExit("no bfloat16 screen pass on this machine: nothing to compare")
    kept = screen.passes["bf16"]
    variants = {"widened": lambda x: kept(x).float(), "kept": kept}
    with torch.inference_mode():
        lengths = [150 + 4 * r for r in range(B)]  # about the throughput prompts' context
        kv, _ = target.prefill([(7 * i + 3) % 1000 for i in range(max(lengths))], chunk=CONTEXT_CHUNK)
        kv.repeat_row(lengths)
        chains = own_continuations(target, kv, max(sizes))

        def step(n):
            out = target([StepRow.chain(kv.lengths[r], chains[r][:n]) for r in range(B)], kv, all_logits=True,
                         exact=False)
            out.nodes.argmax
            kv.commit([[] for _ in range(B)])

        for n in sizes:
            for _ in range(6):  # the screen settles its pass per row count
                step(n)
        times = {(v, n): [] for v in variants for n in sizes}
        for _ in range(args.rounds):
            for v, f in variants.items():
                screen.passes["bf16"] = f
                for n in sizes:
                    t0 = time.perf_counter()
                    step(n)
                    times[(v, n)].append(time.perf_counter() - t0)
    print("screen passes:", screen.choices())
    for n in sizes:
        print(f"{B} rows x {n}:", {v: round(statistics.median(times[(v, n)]) * 1e3, 1) for v in variants}, "ms")


if __name__ == "__main__":
    main()
