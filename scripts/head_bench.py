"""Output-layer cost per verified node count: float32 ``F.linear``, ``W @ h.T`` and the screened
greedy argmax (logitspec.head.ScreenedArgmax) with each float16 pass (the F16C skinny kernel,
fbgemm), on real hidden states of the embedded model; also checks that each screened argmax equals
the float32 one on every measured row.

    .venv/bin/python scripts/head_bench.py [--threads 2] [--model default]
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from logitspec import load_model
from logitspec.head import ScreenedArgmax


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    weight = model.get_output_embeddings().weight.detach()  # [V, H]
    screens = {kind: ScreenedArgmax(weight, kind=kind) for kind in ScreenedArgmax.KINDS}
    text = " ".join(["Speculative decoding verifies drafted tokens in one forward pass."] * 40)
    ids = tok(text, return_tensors="pt").input_ids[:, :256]
    with torch.inference_mode():
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state[0]  # [T, H]
        print(f"threads {torch.get_num_threads()}, output layer {tuple(weight.shape)}")
        print("| nodes | F.linear ms | W @ h.T ms | " + " | ".join(f"screened ({k}) ms" for k in screens)
              + " | argmax equal |\n|---|---|---|" + "---|" * len(screens) + "---|")
        for n in (1, 2, 4, 8, 16, 32):
            h = hidden[-n:].contiguous()
            ref = F.linear(h, weight).argmax(dim=1)
            same = all(torch.equal(s(h).argmax, ref) for s in screens.values())
            row = [median_ms(lambda: F.linear(h, weight), args.reps),
                   median_ms(lambda: torch.mm(weight, h.T), args.reps)]
            row += [median_ms(lambda s=s: s(h), args.reps) for s in screens.values()]
            print(f"| {n} | " + " | ".join(f"{x:.1f}" for x in row) + f" | {same} |")


if __name__ == "__main__":
    main()
