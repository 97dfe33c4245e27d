"""How close a decoding step's linears run to this machine's memory bandwidth.

    .venv/bin/python scripts/linear_bandwidth.py [--rows 1,6,24] [--shapes 2048x640,640x2048,4864x896,896x4864]

Prints the streaming rate of a plain read (``sum`` of 400 MB) and, per weight shape and row count,
the weight bytes per second of oneDNN's packed linear (what the engine swaps in) and of our skinny
kernel (1-8 rows), each over 20 distinct weights so that no weight is read from cache. Fastest of
10 calls after a warm-up.
"""
import argparse

import torch

from logitspec.device import fastest
from logitspec.kernels import onednn, skinny

CPU = torch.device("cpu")


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,6,24")
    ap.add_argument("--shapes", default="2048x640,640x2048,4864x896,896x4864", help="out x in, comma-separated")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(100_000_000, generator=gen)  # 400 MB
    print(f"plain read (sum of 400 MB): {0.4 / fastest(lambda: big.sum(), CPU):.1f} GB/s")
    del big
    for shape in args.shapes.split(","):
        n_out, n_in = (int(v) for v in shape.split("x"))
        weights = [torch.randn(n_out, n_in, generator=gen) * 0.02 for _ in range(20)]  # [O, I] each
        packed = [onednn.pack(w) for w in weights] if onednn.available() else []
        gb = sum(w.numel() for w in weights) * 4 / 1e9
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, n_in, generator=gen)  # [m, I]
            line = [f"{n_out}x{n_in} {m:3d} rows:"]
            if packed:
                line.append(f"oneDNN {gb / fastest(lambda: [onednn.linear(x, p) for p in packed], CPU):5.1f} GB/s")
            if m <= skinny.MAX_ROWS and skinny.available():
                dt = fastest(lambda: [skinny.skinny_linear(x, w, None, skinny.MAX_ROWS) for w in weights], CPU)
                line.append(f"skinny {gb / dt:5.1f} GB/s")
            print("  ".join(line), flush=True)


if __name__ == "__main__":
    main()
