"""Time the skinny-linear kernel (logitspec/kernels/skinny.py) against F.linear, and the real model's decoder
forward with and without ``use_skinny_linears``. One thread unless ``--threads N``.

    .venv/bin/python scripts/skinny_bench.py                 # both parts
    .venv/bin/python scripts/skinny_bench.py --part kernel   # (a) only
    .venv/bin/python scripts/skinny_bench.py --part decoder  # (b) only

(a) Per weight shape (O, I) and row count n: time per call, weights cold: the timed loop cycles
    through enough copies of the weight (>= --cold-mb MB in all) that each call streams its weight
    from DRAM, as in a decoder forward. Median over --reps passes; kernel and F.linear interleaved.
(b) Embedded model (``load_model("default", attn_implementation="eager")``): 256-token context in a
    DynamicCache, then one decoder forward of n new tokens (position_ids after the context), cache
    cropped back after each; median of --forward-reps; sizes and with/without interleaved per rep.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from logitspec.kernels import skinny

SHAPES = ((1024, 640), (2048, 640), (640, 2048), (256, 640))
ROWS = (1, 2, 4, 8, 16, 32)


def bench_kernel(rows, cold_mb: float, reps: int) -> None:
    print(f"\n(a) kernel vs F.linear, us per call, weights cold (>= {cold_mb:.0f} MB cycled), 1 thread")
    print(f"{'O x I':>11} {'n':>3} {'F.linear':>9} {'skinny':>8} {'speedup':>7} {'max rel err':>11}")
    g = torch.Generator().manual_seed(0)
    for O, I in SHAPES:
        copies = max(2, int(cold_mb * 2**20 / (O * I * 4)) + 1)
        Ws = [torch.randn(O, I, generator=g) for _ in range(copies)]
        for n in rows:
            x = torch.randn(n, I, generator=g)
            ref = F.linear(x.double(), Ws[0].double())
            err = ((skinny.skinny_linear(x, Ws[0]).double() - ref).abs().max() / ref.abs().max()).item()
            times = {"F.linear": [], "skinny": []}
            fns = {"F.linear": F.linear, "skinny": skinny.skinny_linear}
            for rep in range(reps + 1):  # first pass is a warm-up
                for name in (("F.linear", "skinny") if rep % 2 else ("skinny", "F.linear")):
                    fn = fns[name]
                    t0 = time.perf_counter()
                    for W in Ws:
                        fn(x, W)
                    dt = (time.perf_counter() - t0) / copies
                    if rep:
                        times[name].append(dt)
            tf, ts = (statistics.median(times[k]) * 1e6 for k in ("F.linear", "skinny"))
            print(f"{O:>5}x{I:<5} {n:>3} {tf:>9.0f} {ts:>8.0f} {tf / ts:>6.2f}x {err:>11.1e}", flush=True)
        del Ws


@torch.inference_mode()
def bench_decoder(rows, context: int, reps: int) -> None:
    from transformers import DynamicCache

    from logitspec import load_model

    model, tok = load_model("default", attn_implementation="eager", cpu_kernels=False)  # stock nn.Linear first
    decoder = model.get_decoder()
    vocab = model.config.get_text_config(decoder=True).vocab_size
    plain = {name: m for name, m in model.named_modules() if type(m) is nn.Linear}
    swapped = skinny.use_skinny_linears(model)
    fast = {name: model.get_submodule(name) for name in plain}

    def use(mods):
        for name, m in mods.items():
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, m)

    ctx = torch.tensor([[(7 * i + 3) % vocab for i in range(context)]])
    cache = DynamicCache(config=model.config)
    decoder(input_ids=ctx, position_ids=torch.arange(context)[None], past_key_values=cache, use_cache=True)
    modes = {"F.linear": plain, "skinny": fast}
    times = {(m, n): [] for m in modes for n in rows}
    outs = {}
    for rep in range(reps + 1):  # first pass is a warm-up
        for n in rows:
            ids = torch.tensor([[(5 * i + 1) % vocab for i in range(n)]])
            pos = torch.arange(context, context + n)[None]
            for mode in (("F.linear", "skinny") if (rep + n) % 2 else ("skinny", "F.linear")):
                use(modes[mode])
                t0 = time.perf_counter()
                h = decoder(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True).last_hidden_state
                dt = time.perf_counter() - t0
                cache.crop(-n)  # drop the n new tokens (this transformers takes a negative count)
                assert cache.get_seq_length() == context
                if rep:
                    times[mode, n].append(dt)
                else:
                    outs[mode, n] = h
    use(plain)
    print(f"\n(b) decoder forward (embedded model, eager attention, {context}-token context, "
          f"{swapped} linears swapped), ms, median of {reps}, {torch.get_num_threads()} threads")
    print(f"{'n':>3} {'F.linear':>9} {'skinny':>8} {'speedup':>7} {'max |dh| / max |h|':>18}")
    for n in rows:
        tf, ts = (statistics.median(times[m, n]) * 1e3 for m in modes)
        h0 = outs["F.linear", n]
        dh = ((h0 - outs["skinny", n]).abs().max() / h0.abs().max()).item()
        print(f"{n:>3} {tf:>9.1f} {ts:>8.1f} {tf / ts:>6.2f}x {dh:>18.1e}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("kernel", "decoder", "both"), default="both")
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated n")
    p.add_argument("--cold-mb", type=float, default=400.0)
    p.add_argument("--reps", type=int, default=5, help="(a): timed passes over the weight copies")
    p.add_argument("--forward-reps", type=int, default=7, help="(b): timed forwards per n and mode")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (both kernels use them)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)
    if not skinny.available():
        print(f"kernel unavailable: {skinny.unavailable_reason()}", file=sys.stderr)
        return 1
    rows = [int(r) for r in args.rows.split(",")]
    if args.part in ("kernel", "both"):
        bench_kernel(rows, args.cold_mb, args.reps)
    if args.part in ("decoder", "both"):
        bench_decoder(rows, args.context, args.forward_reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
