"""Cost of appending one decode step's KV columns to every layer: transformers' ``DynamicLayer``
(concatenates the whole cache each step) against ``logitspec.cache.GrowingLayer`` (writes in place),
at several context lengths, with Gemma 3 270M's cache shapes by default (18 layers, 1 KV head, dim 256).

    .venv/bin/python scripts/cache_bench.py [--layers 18 --heads 1 --dim 256 --new 4]
"""
import argparse
import statistics
import time

import torch
from transformers.cache_utils import DynamicLayer

from logitspec.cache import GrowingLayer


def step_ms(layer_cls, layers: int, heads: int, dim: int, context: int, new: int, steps: int = 30) -> float:
    """Median time of one step appending ``new`` columns to each of ``layers`` layers that already
    hold ``context`` columns."""
    kv = torch.randn(1, heads, context, dim)
    cache = [layer_cls() for _ in range(layers)]
    for layer in cache:
        layer.update(kv, kv.clone())
    step = torch.randn(1, heads, new, dim)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        for layer in cache:
            layer.update(step, step)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--new", type=int, default=4, help="columns appended per step")
    args = ap.parse_args()
    print(f"{args.layers} layers x [1, {args.heads}, context, {args.dim}] float32 keys and values, "
          f"{args.new} new columns per step, {torch.get_num_threads()} threads")
    print("| context | DynamicLayer ms/step | GrowingLayer ms/step |\n|---|---|---|")
    for context in (256, 1024, 2048, 4096):
        row = [step_ms(cls, args.layers, args.heads, args.dim, context, args.new) for cls in (DynamicLayer, GrowingLayer)]
        print(f"| {context} | {row[0]:.2f} | {row[1]:.2f} |")


if __name__ == "__main__":
    main()
