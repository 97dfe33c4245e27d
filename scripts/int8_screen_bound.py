"""How many tokens an int8 screen of the output layer would leave to rescore, on real final hidden states.

    .venv/bin/python scripts/int8_screen_bound.py [--model default] [--outliers 0,32] [--batch-sizes 6,24]

An exact screen computes approximate logits a_v, a provable bound e_v >= |a_v - exact_v| per token,
and rescores in float32 every token with a_v + e_v >= max_u (a_u - e_u). Weights: int8 per output row
(scale max|W_v| / 127). Two kinds:
- dynamic int8 (as fbgemm's ``quantized::linear_dynamic``): activations rounded to uint8 over the
  batch, e_v = ||dW_v|| ||x~|| + ||W_v|| ||x~ - x||;
- weight-only int8 (float32 activations): e_v = ||dW_v|| ||x||.
The ``--outliers`` channels with the largest mean |x| are computed exactly in float32 and left out of
both (Gemma 3's final states have channels of magnitude 45-130 against a median of 2.3). A float32
slack of 1e-4 ||W_v|| ||x|| is added. Prints the candidate counts per row and the gap between each
state's two best logits. ``--time``: the output-layer pass alone, the screen's bfloat16 oneDNN pass
against fbgemm's dynamic int8 (per-row int8 weights, prepacked), alternating, fastest of 20 calls.
"""
import argparse
import time
import warnings

import torch

from logitspec.bench.questions import first_turns
from logitspec.kernels import onednn
from logitspec.models import load_model


def stats(counts: list[int]) -> str:
    c = torch.tensor(counts, dtype=torch.float)
    return (f"mean {c.mean():.1f} median {c.median():.0f} p90 {torch.quantile(c, 0.9):.0f} max {c.max():.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--outliers", default="0,32", help="comma-separated counts of exact channels")
    ap.add_argument("--batch-sizes", default="6,24")
    ap.add_argument("--time", action="store_true", help="also time the bfloat16 pass against dynamic int8")
    args = ap.parse_args()
    model, tok = load_model(args.model)
    with torch.inference_mode():
        if args.time:
            time_passes(model.get_output_embeddings().weight.float(), [int(v) for v in args.batch_sizes.split(",")])
        states = []
        for text in first_turns(None, 3, max_chars=1500)[:12]:  # Spec-Bench first turns, 300 tokens each at most
            ids = tok(text, return_tensors="pt").input_ids[:, :300]
            states.append(model.model(input_ids=ids).last_hidden_state[0])
        X = torch.cat(states)  # [n, H]
        W = model.get_output_embeddings().weight.float()  # [V, H]
        top2 = (X @ W.T).topk(2, dim=1).values  # [n, 2]
        gap = top2[:, 0] - top2[:, 1]
        print(f"{len(X)} states; gap between the two best logits: p10 / p50 / p90 "
              f"{[round(v, 2) for v in torch.quantile(gap, torch.tensor([0.1, 0.5, 0.9])).tolist()]}")
        scale = W.abs().amax(1) / 127  # [V]
        Wq = torch.round(W / scale[:, None]).clamp(-127, 127) * scale[:, None]  # [V, H] int8 values, dequantized
        dW, wn = (Wq - W).norm(dim=1), W.norm(dim=1)  # [V] each
        order = X.abs().mean(0).argsort(descending=True)
        for k in (int(v) for v in args.outliers.split(",")):
            O, R = order[:k], order[k:]
            WqR, WO = Wq[:, R].T.contiguous(), W[:, O].T.contiguous()  # [H-k, V], [k, V]
            for B in (int(v) for v in args.batch_sizes.split(",")):
                dyn, wonly = [], []
                for i in range(0, len(X) - B + 1, B):
                    x = X[i:i + B]  # [B, H]
                    xr, exact_part = x[:, R], x[:, O] @ WO  # [B, H-k], [B, V]
                    lo, hi = min(xr.min().item(), 0.0), max(xr.max().item(), 0.0)
                    s = (hi - lo) / 255
                    zero = round(-lo / s)
                    xt = ((torch.round(xr / s) + zero).clamp(0, 255) - zero) * s  # [B, H-k] uint8 values
                    slack = 1e-4 * wn[None, :] * x.norm(dim=1)[:, None]  # [B, V]
                    for approx, bound, out in (
                            (xt @ WqR + exact_part, dW[None, :] * xt.norm(dim=1)[:, None]
                             + wn[None, :] * (xt - xr).norm(dim=1)[:, None] + slack, dyn),
                            (xr @ WqR + exact_part, dW[None, :] * xr.norm(dim=1)[:, None] + slack, wonly)):
                        floor = (approx - bound).amax(1, keepdim=True)  # [B, 1]
                        out += ((approx + bound) >= floor).sum(1).tolist()
                print(f"exact channels {k:2d}, {B:2d} rows: candidates a row, dynamic int8 {stats(dyn)}; "
                      f"weight-only int8 {stats(wonly)}")


def time_passes(W: torch.Tensor, batch_sizes: list[int], calls: int = 20) -> None:
    """ms per call of the screen's bfloat16 pass and of fbgemm's dynamic int8 linear, alternating."""
    packed16 = onednn.pack(W.bfloat16())  # the screen's "bf16" pass (logitspec.head)
    with warnings.catch_warnings():  # quantize_per_channel's deprecation notice
        warnings.simplefilter("ignore")
        scale = (W.abs().amax(1) / 127).double()
        wq = torch.quantize_per_channel(W, scale, torch.zeros(len(W), dtype=torch.long), 0, torch.qint8)
        packed = torch.ops.quantized.linear_prepack(wq, None)
    passes = {"bf16": lambda x: onednn.linear(x.bfloat16(), packed16), "int8": lambda x: torch.ops.quantized.linear_dynamic(x, packed, True)}
    for B in batch_sizes:
        x = torch.randn(B, W.shape[1]) * 3
        best = {k: float("inf") for k in passes}
        for _ in range(3):
            for name, f in passes.items():
                f(x)
                for _ in range(calls):
                    t = time.perf_counter()
                    f(x)
                    best[name] = min(best[name], time.perf_counter() - t)
        print(f"{B:2d} rows: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in best.items()))


if __name__ == "__main__":
    main()
